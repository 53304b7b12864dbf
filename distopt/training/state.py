"""Cutting and restoring a trainer's checkpoint (directory layout: :mod:`distopt.training.checkpoint`).

What makes a resumed run end with exactly the parameters of an uninterrupted one:

- dense model and optimizer state through ``torch.distributed.checkpoint`` (DCP): the state dict
  of ``get_state_dict`` (FQN keys, DDP's ``module.`` prefix dropped, FSDP shards as DTensors);
- the data position: the completed step count, and in the rank file the micro-batches consumed
  (batches depend only on seed, rank and position; see ``distopt.data.Loader.batches``);
- the learning-rate scheduler's state and anything else the trainer passes as ``extra``;
- the RNG states (torch CPU generator, the current CUDA device's when CUDA is in use, Python's
  ``random``; NumPy's global generator is not used by distopt and not saved), restored
  immediately before the first resumed step;
- the parameter-server tables and their optimizer state, written by each server
  (``Hooks.save_remote``) after every trainer drained its pushes (``Hooks.before_checkpoint``),
  while every trainer waits at a barrier: no push lands during the save.

A cut: drain pushes → barrier → trainer 0 has the servers write → every trainer writes dense and
its rank file → barrier → trainer 0 writes the manifest (then the checkpoint is complete).
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import logging
import random
import time
import warnings
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from distopt.atomic import atomic_torch_save
from distopt.errors import ConfigError
from distopt.training import checkpoint
from distopt.training.checkpoint import Checkpoint

logger = logging.getLogger(__name__)


@dataclasses.dataclass(kw_only=True, slots=True, frozen=True)
class TrainerState:
    """What one trainer checkpoints and where its dense state lives in a checkpoint."""

    model: nn.Module
    """Module whose parameter names key the dense state (the original model, or the FSDP one)."""
    optimizer: torch.optim.Optimizer
    rank: int
    collective: bool
    """Dense state written and read collectively by every trainer (replicated or sharded)."""
    dense_dir: str
    """``dense`` (one copy for the job) or ``dense-rank<r>`` (each trainer its own model)."""
    job: Mapping[str, Any]
    """The job's shape, recorded in the manifest and checked on resume."""


def _world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def barrier() -> None:
    """Wait for every trainer (a no-op for a lone trainer)."""
    if _world() > 1:
        dist.barrier()


def trainer_state(
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    rank: int,
    parallel: str,
    num_trainers: int,
    job: Mapping[str, Any],
) -> TrainerState:
    """Where this trainer's dense state goes: shared when DDP/FSDP keep one model for the job."""
    own_model = num_trainers > 1 and parallel == "none"
    return TrainerState(
        model=model,
        optimizer=optimizer,
        rank=rank,
        collective=not own_model and _world() > 1,
        dense_dir=f"dense-rank{rank}" if own_model else "dense",
        job=job,
    )


def rng_state() -> dict[str, Any]:
    """The RNG states a training step may draw from."""
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()  # the current device: one GPU per trainer
    return state


def set_rng_state(state: Mapping[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


@contextlib.contextmanager
def _single_process(state: TrainerState) -> Iterator[None]:
    """DCP warns that it "assumes" a single process even when told so (``no_dist``): silence it."""
    with warnings.catch_warnings():
        if not state.collective:
            warnings.filterwarnings("ignore", message=".*assuming the intent is to")
        yield


def _dense(state: TrainerState) -> dict[str, Any]:
    model_sd, optim_sd = get_state_dict(state.model, state.optimizer)
    return {"model": model_sd, "optimizer": optim_sd}


def cut(
    root: Path,
    state: TrainerState,
    *,
    step: int,
    extra: Mapping[str, Any] | None = None,
    before: Callable[[], None] | None = None,
    save_remote: Callable[[Path], None] | None = None,
    check: Callable[[], None] | None = None,
) -> Checkpoint | None:
    """Write the checkpoint after ``step`` steps; every trainer calls this at the same step.

    ``extra`` goes into this trainer's rank file next to ``step`` and ``rng`` (plain data and
    tensors: it is loaded with ``weights_only``). ``before`` runs on every trainer first (drain
    pushes), ``save_remote(path)`` on trainer 0 while the others wait (the servers write their
    shards), ``check`` on every trainer after that (raising there, together, abandons the
    checkpoint before it can be complete). Returns the checkpoint on trainer 0.
    """
    begin = time.perf_counter()
    if before is not None:
        before()
    path = checkpoint.step_dir(root, step)
    if state.rank == 0:
        checkpoint.begin(root, step)
    barrier()  # the directory exists and every trainer's pushes have landed
    if state.rank == 0 and save_remote is not None:
        save_remote(path)
    if check is not None:
        check()
    with _single_process(state):
        dcp.save(_dense(state), checkpoint_id=path / state.dense_dir, no_dist=not state.collective)
    rank_file = {**(extra or {}), "step": step, "rng": rng_state()}
    atomic_torch_save(rank_file, path / f"rank{state.rank}.pt")
    barrier()  # every file is written; no trainer pushes before the servers have saved
    if state.rank != 0:
        return None
    done = checkpoint.finish(path, step=step, job=state.job)
    logger.info("checkpoint %s (%.2f s)", path, time.perf_counter() - begin)
    return done


def _agree(found: Checkpoint | None, root: Path) -> Checkpoint | None:
    """Trainer 0's choice of checkpoint, for every trainer (one scan, one decision)."""
    if _world() == 1:
        return found
    choice = [str(found.path) if found is not None else None]
    dist.broadcast_object_list(choice, src=0)
    if choice[0] is None:
        return None
    agreed = checkpoint.check_complete(choice[0])
    if not isinstance(agreed, Checkpoint):
        raise ConfigError(f"resume: checkpoint {choice[0]} is not readable here: {agreed}")
    return agreed


def _check_shape(found: Checkpoint, job: Mapping[str, Any]) -> None:
    for key in ("num_trainers", "num_ps", "parallel"):
        if key in job and found.job.get(key) != job[key]:
            raise ConfigError(
                f"resume: checkpoint {found.path} was written with {key}={found.job.get(key)!r}, "
                f"this job has {key}={job[key]!r}"
            )


def find(root: Path, *, rank: int, job: Mapping[str, Any]) -> Checkpoint | None:
    """The newest complete checkpoint under ``root`` (trainer 0 decides; incomplete ones named),
    checked against the shape of ``job``. Every trainer calls this; it needs only the group, so
    a trainer can look before it builds what the checkpoint restores."""

    def skipped(path: Path, reason: str) -> None:
        logger.warning("ignoring incomplete checkpoint %s: %s", path, reason)

    found = checkpoint.latest_complete(root, on_skip=skipped) if rank == 0 else None
    found = _agree(found, root)
    if found is not None:
        _check_shape(found, job)
    return found


def restore(
    found: Checkpoint, state: TrainerState, *, load_remote: Callable[[Path], None] | None = None
) -> dict[str, Any]:
    """Load dense state (and, on trainer 0, the servers' tables) from ``found``; returns this
    trainer's rank file (``step``, ``rng`` — applied later by :func:`set_rng_state` — and the
    ``extra`` it was cut with)."""
    dense = _dense(state)
    with _single_process(state):
        dcp.load(dense, checkpoint_id=found.path / state.dense_dir, no_dist=not state.collective)
    set_state_dict(
        state.model,
        state.optimizer,
        model_state_dict=dense["model"],
        optim_state_dict=dense["optimizer"],
    )
    rank_file = found.path / f"rank{state.rank}.pt"
    try:
        saved = torch.load(rank_file, map_location="cpu", weights_only=True)
    except (OSError, RuntimeError) as err:
        raise ConfigError(f"resume: cannot load {rank_file}: {err}") from None
    if saved.get("step") != found.step:
        raise ConfigError(f"resume: {rank_file} is at step {saved.get('step')}, not {found.step}")
    if state.rank == 0 and load_remote is not None:
        load_remote(found.path)
    barrier()  # no trainer starts before the servers hold the checkpoint's tables
    if state.rank == 0:
        logger.info("resumed from %s (step %d)", found.path, found.step)
    return saved


def read_tensors(found: Checkpoint) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint, flat, for inspection and comparison: dense state as
    ``dense/model/<name>`` (``dense-rank<r>/...`` for per-trainer models), optimizer tensors under
    ``dense/optimizer/...``, tables as ``ps<i>/<table>/weight`` and ``.../accum`` (Adagrad)."""
    flat: dict[str, torch.Tensor] = {}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, torch.Tensor):
            flat[prefix] = value
        elif isinstance(value, Mapping):
            for key, item in value.items():
                walk(f"{prefix}/{key}", item)

    for dense in sorted(found.path.glob("dense*")):
        buffer = io.BytesIO()
        dcp_to_torch_save(dense, buffer)  # type: ignore[arg-type]
        buffer.seek(0)
        walk(dense.name, torch.load(buffer, weights_only=True))
    for server in sorted(found.path.glob("ps*.pt")):
        walk(server.stem, torch.load(server, weights_only=True)["tables"])
    return flat
