"""What a successful run must not print: warnings, tracebacks, C++ log warnings (``[W1125 ...``),
TensorPipe's shutdown errors. Tests of quiet runs assert ``noise(stderr) == []``."""

from __future__ import annotations

import re

_NOISE = re.compile(
    r"Warning|warn\(|\[W\d{4}|Traceback|Error|EOF: end of file|pipe closed", re.IGNORECASE
)


def noise(text: str) -> list[str]:
    """The lines of ``text`` that a quiet run would not print."""
    return [line for line in text.splitlines() if _NOISE.search(line)]
