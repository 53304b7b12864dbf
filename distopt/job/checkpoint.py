"""Checkpoints: ``torch.save`` of model and optimizer state, written atomically.

Each save goes to a temporary file in the same directory, is fsynced, then renamed over
``step-<N>.pt``: a reader (or a restarted job) never sees a half-written checkpoint.
"""

from __future__ import annotations

import os
import pickle
import re
import tempfile
from pathlib import Path
from typing import Any

import torch
from torch import nn

from distopt.errors import ConfigError

_NAME = re.compile(r"^step-(\d+)\.pt$")


def checkpoint_path(directory: str | Path, step: int) -> Path:
    """Path of the checkpoint taken after ``step`` steps."""
    return Path(directory) / f"step-{step:08d}.pt"


def save_checkpoint(
    directory: str | Path,
    *,
    step: int,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    extra: dict[str, Any] | None = None,
) -> Path:
    """Save ``{"step", "model", "optimizer", **extra}`` after ``step`` completed steps."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    final = checkpoint_path(directory, step)
    state = {"step": step, "model": model.state_dict(), "optimizer": optimizer.state_dict()}
    state.update(extra or {})
    fd, tmp = tempfile.mkstemp(prefix=f".{final.name}.", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "wb") as stream:
            torch.save(state, stream)
            stream.flush()
            os.fsync(stream.fileno())
        os.replace(tmp, final)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return final


def latest_checkpoint(directory: str | Path) -> Path | None:
    """The checkpoint with the highest step in ``directory``, or None."""
    directory = Path(directory)
    if not directory.is_dir():
        return None
    found = [(int(m.group(1)), p) for p in directory.iterdir() if (m := _NAME.match(p.name))]
    return max(found)[1] if found else None


def load_checkpoint(
    path: str | Path, *, model: nn.Module, optimizer: torch.optim.Optimizer
) -> dict[str, Any]:
    """Restore ``model`` and ``optimizer`` from ``path``; returns the whole saved state
    (``state["step"]`` is the number of completed steps, extras are as saved)."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except (OSError, RuntimeError, pickle.UnpicklingError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ConfigError(f"checkpoint {path}: cannot load ({first})") from None
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    return state
