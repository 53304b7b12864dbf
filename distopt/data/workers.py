"""How training batches get from loader worker processes to the trainer, cheaply.

A DataLoader worker gets a task (indices) over a queue and sends back its result over another.
Per task that costs both processes several thread wake-ups and pickling, and torch's default
moves every tensor of the result to a new shared-memory file whose descriptor goes over a
fresh, authenticated socket connection. For a DLRM batch (3 tensors, 36 KB) that cost the
trainer about 1.5 ms and the worker another 1.5 ms of CPU per batch on 2 busy cores, against a
25 ms step (benchmark ``data_loading``). Two changes, neither of which changes a batch or their
order:

- **By value**: a :class:`Batch` (or a list of them) of plain CPU tensors of at most
  ``BY_VALUE_BYTES`` in all is pickled with its bytes through the worker's pipe and unpickled as
  a plain ``Batch`` (:func:`by_value`). Bigger results still go through shared memory, which
  saves copies.
- **Several batches per task** (map-style data): :class:`Tasks` hands a worker up to
  ``MAX_BATCHES_PER_TASK`` consecutive batches at once, as many as fit in ``BY_VALUE_BYTES``
  (one at a time until the first batch shows its size), and :class:`FetchBatches` fetches and
  collates each of them as DataLoader would; the loader then yields them one by one. Batches of
  a megabyte or more still go one per task, so as many batches are in flight as before.

Measured (20k-line click log, batch 128, 2 workers, 2 busy cores), CPU per batch: the trainer
0.41 ms with one batch per task by value, 0.17-0.23 ms with 16; both workers together 0.62 and
0.23-0.30 ms.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset, Sampler

from distopt.data.batch import Batch

BY_VALUE_BYTES = 1 << 20
"""Worker results with at most this many bytes of tensors come back by value."""
MAX_BATCHES_PER_TASK = 16
"""At most this many training batches per worker task (of map-style data)."""

# dtypes numpy shares with torch (tensor.numpy() and torch.from_numpy are exact for them).
_NUMPY_DTYPES = frozenset(
    {
        torch.bool,
        torch.uint8,
        torch.int8,
        torch.int16,
        torch.int32,
        torch.int64,
        torch.float16,
        torch.float32,
        torch.float64,
        torch.complex64,
        torch.complex128,
    }
)


def _plain(value: Any) -> bool:
    return (
        isinstance(value, torch.Tensor)
        and type(value) is torch.Tensor
        and value.device.type == "cpu"
        and value.dtype in _NUMPY_DTYPES
        and value.layout == torch.strided
        and not value.requires_grad
        and not value.is_conj()
        and not value.is_neg()
    )


def _tensors(batch: Batch) -> list[Any]:
    return [*batch.inputs, *(() if batch.targets is None else (batch.targets,))]


def _from_numpy(inputs: tuple[np.ndarray, ...], targets: np.ndarray | None) -> Batch:
    return Batch(
        tuple(torch.from_numpy(a) for a in inputs),
        None if targets is None else torch.from_numpy(targets),
    )


class _ByValue(Batch):
    """A :class:`Batch` whose tensors pickle as bytes; it unpickles as a plain Batch."""

    __slots__ = ()

    def __reduce__(self) -> tuple[Any, ...]:
        targets = None if self.targets is None else self.targets.numpy()
        return (_from_numpy, (tuple(t.numpy() for t in self.inputs), targets))


def by_value(value: Any, limit: int = BY_VALUE_BYTES) -> Any:
    """``value`` to be sent by value: a :class:`Batch` (or a list of them) of plain CPU tensors of
    at most ``limit`` bytes in all pickles with its bytes; anything else is unchanged."""
    batches = value if isinstance(value, list) else [value]
    if not all(isinstance(b, Batch) for b in batches):
        return value
    tensors = [t for b in batches for t in _tensors(b)]
    if not all(_plain(t) for t in tensors) or sum(t.nbytes for t in tensors) > limit:
        return value
    sent = [_ByValue(tuple(b.inputs), b.targets) for b in batches]
    return sent if isinstance(value, list) else sent[0]


def nbytes(value: Any) -> int:
    """Bytes of the tensors in ``value`` (a batch: tensors in tuples, lists and dicts)."""
    if isinstance(value, torch.Tensor):
        return value.nbytes
    if isinstance(value, (tuple, list)):
        return sum(nbytes(v) for v in value)
    if isinstance(value, dict):
        return sum(nbytes(v) for v in value.values())
    return 0


class SendBack:
    """A loader worker's ``collate_fn``: ``collate`` (none: the item as is), then :func:`by_value`."""

    def __init__(self, collate: Callable[[Any], Any] | None = None) -> None:
        self.collate = collate

    def __call__(self, samples: Any) -> Any:
        return by_value(samples if self.collate is None else self.collate(samples))


def batch_count(samples: int, batch_size: int, drop_last: bool) -> int:
    """Batches of ``batch_size`` that ``samples`` make (``drop_last``: full ones only)."""
    return samples // batch_size if drop_last else -(-samples // batch_size)


class Tasks(Sampler[list[list[int]]]):
    """Worker tasks over ``sampler``'s indices: lists of ``per_task`` consecutive batches, the
    batches DataLoader's ``BatchSampler`` makes (``drop_last`` included). ``per_task`` starts at 1;
    :meth:`fit` sets it from a batch's size (later tasks use it)."""

    def __init__(self, sampler: Sampler[int], batch_size: int, drop_last: bool) -> None:
        self.sampler, self.batch_size, self.drop_last = sampler, batch_size, drop_last
        self.per_task = 1

    def fit(self, batch: Any) -> None:
        """As many batches like ``batch`` per task as fit in ``BY_VALUE_BYTES`` (at least 1)."""
        self.per_task = max(1, min(MAX_BATCHES_PER_TASK, BY_VALUE_BYTES // max(1, nbytes(batch))))

    def __iter__(self) -> Iterator[list[list[int]]]:
        task: list[list[int]] = []
        batch: list[int] = []
        for index in self.sampler:
            batch.append(index)
            if len(batch) == self.batch_size:
                task.append(batch)
                batch = []
                if len(task) >= self.per_task:
                    yield task
                    task = []
        if batch and not self.drop_last:
            task.append(batch)
        if task:
            yield task

    def __len__(self) -> int:
        batches = batch_count(len(self.sampler), self.batch_size, self.drop_last)  # type: ignore[arg-type]
        return -(-batches // self.per_task)


class FetchBatches(Dataset):
    """Item ``[indices of a batch, ...]`` (a :class:`Tasks` task) of ``dataset``: those batches,
    each fetched (with ``__getitems__`` when the dataset has it) and collated as DataLoader does."""

    def __init__(self, dataset: Dataset, collate: Callable[[Any], Any]) -> None:
        self.dataset, self.collate = dataset, collate

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getitem__(self, task: list[list[int]]) -> list[Any]:
        getitems = getattr(self.dataset, "__getitems__", None)
        return [
            self.collate(getitems(indices) if getitems else [self.dataset[i] for i in indices])
            for indices in task
        ]


__all__ = [
    "BY_VALUE_BYTES",
    "MAX_BATCHES_PER_TASK",
    "FetchBatches",
    "SendBack",
    "Tasks",
    "batch_count",
    "by_value",
    "nbytes",
]
