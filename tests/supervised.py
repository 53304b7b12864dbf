"""Jobs with parameter servers run as ``python -m distopt.roles.supervise`` runs them, and what
their runs leave: QPS log records and the final checkpoint (dense state and the servers' tables)."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save


def supervise(
    config: str, sets: Sequence[str], *, num_ps: int = 1, num_trainers: int = 2
) -> subprocess.CompletedProcess[str]:
    """The job ``config`` with ``--set`` overrides ``sets``, no restarts; it must succeed."""
    command = [
        sys.executable,
        "-m",
        "distopt.roles.supervise",
        "--config",
        config,
        "--num-ps",
        str(num_ps),
        "--num-trainers",
        str(num_trainers),
        "--max-restarts",
        "0",
    ]
    for value in sets:
        command += ["--set", value]
    done = subprocess.run(command, capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done


def records(run_dir: Path, kind: str, rank: int = 0) -> list[dict[str, Any]]:
    """The ``kind`` records (``step``, ``eval``) of trainer ``rank``'s QPS log."""
    lines = (run_dir / f"qps-rank{rank}.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["type"] == kind]


def final_state(run_dir: Path, steps: int) -> dict[str, Any]:
    """The checkpoint after ``steps``: ``dense`` (trainers' parameters and optimizer state) and
    ``tables`` (server 0's rows and optimizer state)."""
    step = run_dir / "checkpoints" / f"step-{steps:08d}"
    dense = run_dir / "dense.pt"
    dcp_to_torch_save(step / "dense", dense)
    return {
        "dense": torch.load(dense, weights_only=False),
        "tables": torch.load(step / "ps0.pt", weights_only=False),
    }
