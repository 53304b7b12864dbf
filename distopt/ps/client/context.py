"""Per-thread record of the rows fetched during one training step (for pushing their gradients).

Every fetch that completes while grad mode is on returns its rows as a fresh leaf tensor with
``requires_grad=True`` and appends ``(table, ids, rows)`` here. After ``loss.backward()`` the
trainer calls :func:`distopt.ps.push_gradients`, which takes the records and pushes ``rows.grad``.
Records are per thread because each trainer thread runs its own step.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class FetchRecord:
    """Rows of ``table`` fetched for ``ids`` (flat) in the current step; ``rows`` is the leaf."""

    table: str
    ids: torch.Tensor
    rows: torch.Tensor


_LOCAL = threading.local()


def _records() -> list[FetchRecord]:
    records = getattr(_LOCAL, "records", None)
    if records is None:
        records = _LOCAL.records = []
    return records


def record(table: str, ids: torch.Tensor, rows: torch.Tensor) -> None:
    _records().append(FetchRecord(table, ids.reshape(-1), rows))


def current() -> tuple[FetchRecord, ...]:
    """The records of this thread's current step."""
    return tuple(_records())


def take() -> list[FetchRecord]:
    """Remove and return this thread's records (the step is over)."""
    records = _records()
    _LOCAL.records = []
    return records


def discard_step() -> None:
    """Forget this thread's fetched rows without pushing (e.g. after an evaluation step)."""
    _LOCAL.records = []


@contextlib.contextmanager
def isolated_step() -> Iterator[None]:
    """Run a step whose fetched rows must never be pushed (e.g. distopt's verification runs).

    The records made inside are dropped; the records of the step in progress are restored.
    """
    saved = take()
    try:
        yield
    finally:
        _LOCAL.records = saved
