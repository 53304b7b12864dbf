"""Commands as a user types them: in a shell whose ``PATH`` starts with this venv's ``bin`` (as
after ``source .venv/bin/activate``), without ``PYTHONPATH``, so code is found where a user's
shell finds it (the working directory, installed packages)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def run(
    *command: str | Path, cwd: Path, env: dict[str, str] | None = None, timeout: float = 600
) -> subprocess.CompletedProcess[str]:
    """``command`` in ``cwd`` (one torch thread per process, as jobs on a shared host)."""
    full = dict(os.environ, OMP_NUM_THREADS="1", **(env or {}))
    full["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{full.get('PATH', '')}"
    full.pop("PYTHONPATH", None)
    return subprocess.run(
        [str(c) for c in command],
        cwd=cwd,
        env=full,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
