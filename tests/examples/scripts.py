"""Run an example the way its docstring says (``python examples/...``, ``distopt launch ...``)
from the repository's root."""

from __future__ import annotations

import subprocess
from pathlib import Path

from tests import shell

ROOT = Path(__file__).resolve().parents[2]


def run_documented(*command: str | Path, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    """``command`` in the repository's root; it must exit 0 with no traceback on stderr."""
    proc = shell.run(*command, cwd=ROOT, timeout=timeout)
    assert proc.returncode == 0, (
        f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    )
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    return proc
