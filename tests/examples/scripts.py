"""Run an example the way its docstring says (``python examples/...``, ``distopt launch ...``) from
the repository's root, in a shell whose ``PATH`` starts with this venv's ``bin`` (as after
``source .venv/bin/activate``)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_documented(*command: str | Path, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    """``command`` in the repository's root; it must exit 0 with no traceback on stderr."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env.pop("PYTHONPATH", None)  # the example finds its code as a user's shell would
    proc = subprocess.run(
        [str(c) for c in command], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
    )
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    return proc
