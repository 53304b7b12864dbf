"""What a loader yields: a model's positional inputs and, for supervised data, the targets."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np
import torch
from torch.utils.data import default_collate


class Batch(NamedTuple):
    """One batch: ``model(*inputs)`` gives the outputs that ``targets`` score.

    A named tuple, so ``DataLoader`` pins it field by field and workers can send it.
    """

    inputs: tuple[Any, ...]
    """Positional inputs of one forward call."""
    targets: torch.Tensor | None
    """Labels or next tokens; ``None`` for unsupervised data (the model's own loss applies)."""


def to_batch(value: Any) -> Batch:
    """A collated value as a :class:`Batch`: a Batch as is, a tuple or list as the model's
    positional inputs, anything else (one tensor) as the only input; no targets in either case."""
    if isinstance(value, Batch):
        return value
    if isinstance(value, (tuple, list)):
        return Batch(tuple(value), None)
    return Batch((value,), None)


class BatchCollate:
    """``collate_fn`` whose result is turned into a :class:`Batch` (picklable for workers)."""

    def __init__(self, collate: Callable[[list[Any]], Any] | None = None) -> None:
        self.collate = collate or default_collate

    def __call__(self, samples: list[Any]) -> Batch:
        return to_batch(self.collate(samples))


_MASK = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15


def mix64(values: np.ndarray, salt: np.ndarray | int) -> np.ndarray:
    """A stable 64-bit hash of ``values`` (uint64) under ``salt``: the splitmix64 finalizer of
    ``value + golden × (salt + 1)``. Unlike Python's ``hash`` it is the same in every process and
    run (``PYTHONHASHSEED``), and it spreads consecutive integers over the whole range."""
    with np.errstate(over="ignore"):
        salt = (np.asarray(salt, dtype=np.uint64) + np.uint64(1)) * np.uint64(_GOLDEN)
        x = np.asarray(values, dtype=np.uint64) + salt
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


def mix_ints(*ints: int) -> int:
    """:func:`mix64` folded over several non-negative integers (e.g. ``seed, rank, index``)."""
    h = 0
    for value in ints:
        h = int(mix64(np.uint64(value & _MASK), h))
    return h
