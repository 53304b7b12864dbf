"""Data loaders of one trainer: ``torch.utils.data.DataLoader`` placed by rank, endless for
training, one unpadded pass for evaluation.

Training (:func:`build_loader`) places samples in one of three ways, by the kind of dataset:

- **map-style** (``__len__`` + ``__getitem__``): a ``DistributedSampler`` shuffles all indices by
  ``(seed, epoch)`` and gives each rank an equal share (padded with repeats, so every trainer runs
  the same number of steps, as DDP needs); the loader calls ``set_epoch`` at each epoch.
- **indexed streams** (subclasses of :class:`IndexedStream`, e.g. token windows): batch ``b`` of
  rank ``r`` is ``item(r, b × batch_size + i)``; loader worker ``w`` of ``W`` makes batches
  ``b ≡ w (mod W)``, and DataLoader's round-robin over workers puts them back in order, so the data
  is the same for any number of workers. A stream opts in by subclassing, as an
  ``IterableDataset`` does in torch: a dataset that merely has an ``item`` attribute (an item-id
  column) is map-style or iterable like any other.
- **other IterableDatasets**: every process iterates the whole dataset and keeps elements
  ``i ≡ rank × W + w (mod world_size × W)`` (the dataset must yield the same sequence everywhere);
  each pass is an epoch.

Exact resume: :meth:`Loader.batches` ``(start_step)`` yields the batches an uninterrupted run
yields from step ``start_step`` on. Map-style data skips to the batch by sampler index (no sample
of the skipped batches is read); streams compute it; other iterables read and drop the skipped
batches. The order depends on ``seed``, ``rank``, ``world_size``, ``batch_size``, ``drop_last``
(and, for other iterables, ``num_workers``): keep them when resuming.

Held-out data (:func:`holdout_split`): the last ``fraction`` of a map-style dataset's indices —
the newest lines of a log, as the DLRM reference evaluates on the last day. Evaluation
(:func:`build_eval_loader`) reads each held-out sample exactly once over all ranks: rank ``r``
takes indices ``r, r + world_size, ...`` with no padding, so all-reduced metrics are exact.

Loader workers (``num_workers > 0``) fetch and collate whole batches and send small ones back by
value, several per task for map-style data (:mod:`distopt.data.workers`: the same batches in
the same order, at a fraction of DataLoader's per-batch cost between processes).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from typing import Any, TypeVar, cast

import torch
from torch.utils.data import (
    DataLoader,
    Dataset,
    DistributedSampler,
    IterableDataset,
    Sampler,
    Subset,
    default_collate,
    default_convert,
    get_worker_info,
)

from distopt.data.batch import mix_ints
from distopt.data.workers import FetchBatches, SendBack, Tasks, batch_count
from distopt.errors import ConfigError

T_co = TypeVar("T_co", covariant=True)


class IndexedStream(IterableDataset[T_co]):
    """Base class of endless datasets that place their own samples: :meth:`item` ``(rank, index)``
    is sample ``index`` of trainer ``rank``'s stream, a pure function of its arguments (and the
    dataset's seed). Subclass it to have :func:`build_loader` ask for samples by index (exact
    resume without reading the skipped ones); iterating it directly yields rank 0's stream."""

    def item(self, rank: int, index: int) -> T_co:
        raise NotImplementedError(f"{type(self).__name__}.item(rank, index)")

    def __iter__(self) -> Iterator[T_co]:
        worker, workers = _worker()
        index = worker
        while True:
            yield self.item(0, index)
            index += workers


class _SkippingSampler(DistributedSampler):
    """A ``DistributedSampler`` that starts ``skip`` indices into the epoch (for resuming)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.skip = 0

    def __iter__(self) -> Iterator[int]:
        return itertools.islice(super().__iter__(), self.skip, None)

    def __len__(self) -> int:
        return max(0, self.num_samples - self.skip)


class _ShardSampler(Sampler[int]):
    """Indices ``rank, rank + world_size, ...`` of ``length``: every index once over all ranks."""

    def __init__(self, length: int, rank: int, world_size: int) -> None:
        self.indices = range(rank, length, world_size)

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices)

    def __len__(self) -> int:
        return len(self.indices)


def _worker() -> tuple[int, int]:
    info = get_worker_info()
    return (0, 1) if info is None else (info.id, info.num_workers)


class _StreamShard(IterableDataset):
    """Rank ``rank``'s batches ``start, start + 1, ...`` of an :class:`IndexedStream`, split
    between loader workers by batch (``per_batch`` items each; 1 when items are batches)."""

    def __init__(self, stream: IndexedStream, rank: int, per_batch: int, start: int) -> None:
        self.stream, self.rank, self.per_batch, self.start = stream, rank, per_batch, start

    def __iter__(self) -> Iterator[Any]:
        worker, workers = _worker()
        batch = self.start + worker
        while True:
            for i in range(self.per_batch):
                yield self.stream.item(self.rank, batch * self.per_batch + i)
            batch += workers


class _IterableShard(IterableDataset):
    """This process's share of an IterableDataset that yields the same sequence everywhere."""

    def __init__(self, dataset: IterableDataset, rank: int, world_size: int) -> None:
        self.dataset, self.rank, self.world_size = dataset, rank, world_size

    def __iter__(self) -> Iterator[Any]:
        worker, workers = _worker()
        slot, total = self.rank * workers + worker, self.world_size * workers
        return itertools.islice(iter(self.dataset), slot, None, total)


def _collate(
    collate_fn: Callable[[Any], Any] | None, batch_size: int | None, num_workers: int
) -> Callable[[Any], Any] | None:
    """What the DataLoader collates with: ``collate_fn``, in workers sent back by value."""
    if num_workers == 0:
        return collate_fn
    # DataLoader's own defaults: collate a batch's samples, or convert an unbatched item.
    return SendBack(collate_fn or (default_collate if batch_size is not None else default_convert))


def _check_rank(rank: int, world_size: int) -> None:
    if world_size < 1 or not 0 <= rank < world_size:
        raise ConfigError(f"data: rank {rank} outside 0..{world_size - 1}")


def _loader_options(num_workers: int, pin_memory: bool, seed: int, rank: int) -> dict[str, Any]:
    if num_workers < 0:
        raise ConfigError(f"data.num_workers: expected an integer >= 0, got {num_workers}")
    return {
        "num_workers": num_workers,
        "pin_memory": pin_memory and torch.cuda.is_available(),  # pinning helps only H2D copies
        "persistent_workers": num_workers > 0,  # no worker start-up per epoch or evaluation
        # Seeds the workers' torch RNG (base_seed) per rank: user datasets that draw random
        # numbers in workers are reproducible too.
        "generator": torch.Generator().manual_seed(mix_ints(seed, rank) % (1 << 63)),
    }


class Loader:
    """The training batches of trainer ``rank`` (see the module docstring); use
    :meth:`batches` for an endless iterator that advances epochs by itself."""

    def __init__(
        self,
        dataset: Dataset | IterableDataset,
        *,
        rank: int = 0,
        world_size: int = 1,
        batch_size: int | None,
        num_workers: int = 0,
        pin_memory: bool = False,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        seed: int = 0,
        shuffle: bool = True,
        drop_last: bool = True,
    ) -> None:
        _check_rank(rank, world_size)
        if batch_size is not None and batch_size < 1:
            raise ConfigError(f"batch_size: expected an integer >= 1, got {batch_size}")
        self.dataset, self.rank, self.world_size = dataset, rank, world_size
        self.batch_size, self.collate_fn, self.drop_last = batch_size, collate_fn, drop_last
        self.options = _loader_options(num_workers, pin_memory, seed, rank)
        self.sampler: _SkippingSampler | None = None
        self.loader: DataLoader | None = None
        self.tasks: Tasks | None = None  # map-style data with workers: several batches per task
        if isinstance(dataset, IndexedStream):
            self.kind = "stream"
        elif isinstance(dataset, IterableDataset):
            self.kind = "iterable"
            self.loader = self._data_loader(_IterableShard(dataset, rank, world_size))
        else:
            self.kind = "map"
            self.sampler = _SkippingSampler(
                dataset,
                num_replicas=world_size,
                rank=rank,  # type: ignore[arg-type]
                shuffle=shuffle,
                seed=seed,
            )
            if num_workers > 0 and batch_size is not None:
                self.tasks = Tasks(self.sampler, batch_size, drop_last)
                self.loader = DataLoader(
                    FetchBatches(dataset, collate_fn or default_collate),  # type: ignore[arg-type]
                    sampler=self.tasks,
                    batch_size=None,
                    collate_fn=SendBack(),
                    **self.options,
                )
            else:
                self.loader = self._data_loader(dataset, sampler=self.sampler)
            if self.steps_per_epoch == 0:
                raise ConfigError(
                    f"data: {len(dataset)} samples give no full batch of {batch_size} on each of "  # type: ignore[arg-type]
                    f"{world_size} trainers (set drop_last to false or use a smaller batch_size)"
                )

    def _data_loader(self, dataset: Any, **kwargs: Any) -> DataLoader:
        collate = _collate(self.collate_fn, self.batch_size, self.options["num_workers"])
        return DataLoader(
            dataset,
            batch_size=self.batch_size,
            collate_fn=collate,
            drop_last=self.drop_last and self.batch_size is not None,
            **self.options,
            **kwargs,
        )

    @property
    def steps_per_epoch(self) -> int | None:
        """Batches per epoch of map-style data; ``None`` for iterable data."""
        if self.sampler is None or self.loader is None:
            return None
        if self.tasks is not None:
            return batch_count(self.sampler.num_samples, self.tasks.batch_size, self.drop_last)
        skip, self.sampler.skip = self.sampler.skip, 0
        try:
            return len(self.loader)
        finally:
            self.sampler.skip = skip

    def epoch(self, epoch: int, *, skip_batches: int = 0) -> Iterator[Any]:
        """One epoch of map-style data (reshuffled by ``epoch``), from batch ``skip_batches``."""
        if self.sampler is None or self.loader is None:
            raise ConfigError(f"data: {type(self.dataset).__name__} is iterable and has no epochs")
        self.sampler.set_epoch(epoch)
        self.sampler.skip = skip_batches * (self.batch_size or 1)
        if self.tasks is not None:  # the iterator now: it reads the sampler's epoch and skip
            return self._untask(self.tasks, iter(self.loader))
        return iter(self.loader)

    @staticmethod
    def _untask(tasks: Tasks, done: Iterator[list[Any]]) -> Iterator[Any]:
        """The batches of the tasks ``done``, one by one; the first one sizes later tasks."""
        for batches in done:
            if tasks.per_task == 1 and batches:
                tasks.fit(batches[0])
            yield from batches

    def batches(self, start_step: int = 0) -> Iterator[Any]:
        """Endless batches from global step ``start_step`` (0: the start of training)."""
        if self.kind == "stream":
            loader = self._data_loader(
                _StreamShard(
                    cast("IndexedStream[Any]", self.dataset),
                    self.rank,
                    self.batch_size or 1,
                    start_step,
                )
            )
            yield from loader
            return
        if self.kind == "iterable":
            yield from itertools.islice(self._passes(), start_step, None)
            return
        per_epoch = self.steps_per_epoch or 1
        epoch, offset = divmod(start_step, per_epoch)
        while True:
            yield from self.epoch(epoch, skip_batches=offset)
            epoch, offset = epoch + 1, 0

    def _passes(self) -> Iterator[Any]:
        assert self.loader is not None
        while True:
            empty = True
            for batch in self.loader:
                empty = False
                yield batch
            if empty:
                raise ConfigError(
                    f"data: {type(self.dataset).__name__} yielded no batch for "
                    f"rank {self.rank} of {self.world_size}"
                )


def build_loader(
    dataset: Dataset | IterableDataset,
    *,
    rank: int = 0,
    world_size: int = 1,
    batch_size: int | None,
    num_workers: int = 0,
    pin_memory: bool = False,
    collate_fn: Callable[[list[Any]], Any] | None = None,
    seed: int = 0,
    shuffle: bool = True,
    drop_last: bool = True,
) -> Loader:
    """Training batches of trainer ``rank`` of ``world_size`` (see the module docstring).
    ``batch_size=None``: the dataset's items are batches already (e.g. synthetic batches)."""
    return Loader(
        dataset,
        rank=rank,
        world_size=world_size,
        batch_size=batch_size,
        num_workers=num_workers,
        pin_memory=pin_memory,
        collate_fn=collate_fn,
        seed=seed,
        shuffle=shuffle,
        drop_last=drop_last,
    )


def build_eval_loader(
    dataset: Dataset | IterableDataset,
    *,
    rank: int = 0,
    world_size: int = 1,
    batch_size: int | None,
    num_workers: int = 0,
    pin_memory: bool = False,
    collate_fn: Callable[[list[Any]], Any] | None = None,
) -> DataLoader:
    """One pass over held-out ``dataset`` in which every sample is read by exactly one rank."""
    _check_rank(rank, world_size)
    if isinstance(dataset, IndexedStream):
        raise ConfigError(f"data: {type(dataset).__name__} is endless and cannot be a held-out set")
    options = _loader_options(num_workers, pin_memory, 0, rank)
    collate = _collate(collate_fn, batch_size, num_workers)
    common = {"batch_size": batch_size, "collate_fn": collate, "drop_last": False, **options}
    if isinstance(dataset, IterableDataset):
        return DataLoader(_IterableShard(dataset, rank, world_size), **common)
    return DataLoader(dataset, sampler=_ShardSampler(len(dataset), rank, world_size), **common)  # type: ignore[arg-type]


def holdout_split(
    dataset: Dataset, fraction: float, *, key: str = "data.holdout_fraction"
) -> tuple[Subset, Subset]:
    """``(train, held_out)``: the last ``fraction`` of ``dataset``'s indices is held out."""
    length = len(dataset)  # type: ignore[arg-type]
    held = int(round(length * fraction))
    if not 0 < held < length:
        raise ConfigError(
            f"{key}: {fraction} of {length} samples leaves "
            f"{held} held out and {length - held} for training; both must be > 0"
        )
    return Subset(dataset, range(length - held)), Subset(dataset, range(length - held, length))


__all__ = ["IndexedStream", "Loader", "build_eval_loader", "build_loader", "holdout_split"]
