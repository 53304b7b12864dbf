"""Synthetic batches from the model registry (:func:`distopt.models.make_inputs`) as a data source.

Items are whole batches (build the loader with ``batch_size=None``): a model's inputs function
makes a batch at once, and not every model's inputs split into samples. Batch ``index`` of trainer
``rank`` is the ``index % num_batches``-th of that rank's ``num_batches`` distinct batches, seeded
by ``seed × 100003 + rank × 1009 + i`` as the trainer seeds them today, so the data order depends
only on ``(seed, rank, step)`` and a resumed run sees the batches an uninterrupted one would. Each
batch is made once per process and then reused, which keeps generation out of the steady state.
There are no targets: the model's own loss (``distopt.models.loss_function``) applies.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from distopt import models
from distopt.config import check
from distopt.data.batch import Batch
from distopt.data.loader import IndexedStream


def batch_seed(seed: int, rank: int, index: int) -> int:
    """The ``make_inputs`` seed of distinct batch ``index`` of trainer ``rank``."""
    return seed * 100_003 + rank * 1009 + index


class SyntheticBatches(IndexedStream[Batch]):
    """Endless synthetic batches of model ``name``: :meth:`item` ``(rank, index)`` is the batch
    of step ``index`` of trainer ``rank``."""

    batched = True
    """Items are batches: loaders use ``batch_size=None``."""

    def __init__(
        self, name: str, model: nn.Module, *, batch_size: int, num_batches: int = 4, seed: int = 0
    ) -> None:
        check(batch_size >= 1, "batch_size", "an integer >= 1", batch_size)
        check(num_batches >= 1, "data.synthetic_batches", "an integer >= 1", num_batches)
        self.name, self.model = name, model
        self.batch_size, self.num_batches, self.seed = batch_size, num_batches, seed
        self._cache: dict[tuple[int, int], Batch] = {}

    def item(self, rank: int, index: int) -> Batch:
        key = (rank, index % self.num_batches)
        if key not in self._cache:
            inputs = models.make_inputs(
                self.name, self.model, self.batch_size, seed=batch_seed(self.seed, *key)
            )
            self._cache[key] = Batch(inputs, None)
        return self._cache[key]

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_cache"] = {}
        return state


__all__ = ["SyntheticBatches", "batch_seed"]
