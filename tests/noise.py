"""What a successful run must not print: warnings, tracebacks, C++ and Python log warnings
(``[W1125 ...``, ``W1128 ...``), TensorPipe's shutdown errors. Tests of quiet runs assert
``noise(stderr) == []``."""

from __future__ import annotations

import re

_NOISE = re.compile(
    r"Warning|warn\(|\[W\d{4}|Traceback|Error|EOF: end of file|pipe closed"
    # torch's Python log records (``W1128 16:14:31.181000 15267 torch/_dynamo/...] Graph break
    # ...``, ``[rank0]:W1128 ...``): no word above is in them.
    r"|^(?:\[rank\d+\]:)?[WE]\d{4} \d\d:\d\d:\d\d",
    re.IGNORECASE,
)


def noise(text: str) -> list[str]:
    """The lines of ``text`` that a quiet run would not print."""
    return [line for line in text.splitlines() if _NOISE.search(line)]
