"""Batches from loader workers to the trainer (distopt.data.workers)."""

from __future__ import annotations

import itertools
import pickle
from multiprocessing.reduction import ForkingPickler

import pytest
import torch
from torch.utils.data import BatchSampler, Dataset, SequentialSampler

from distopt.data.batch import Batch, BatchCollate
from distopt.data.loader import build_loader
from distopt.data.workers import BY_VALUE_BYTES, MAX_BATCHES_PER_TASK, Tasks, by_value


def _same(a: Batch, b: Batch) -> bool:
    pairs = zip((*a.inputs, a.targets), (*b.inputs, b.targets), strict=True)
    return all(
        x is None and y is None or x.dtype == y.dtype and torch.equal(x, y) for x, y in pairs
    )


def test_small_batches_pickle_by_value_and_come_back_plain() -> None:
    small = Batch(
        (torch.arange(6).reshape(2, 3), torch.ones(2, 2, dtype=torch.float16)), torch.zeros(2, 1)
    )
    sent = by_value(small, 1 << 20)
    data = bytes(ForkingPickler.dumps(sent))
    # torch's default for tensors: a shared-memory file per tensor, its descriptor over a socket.
    assert b"rebuild_storage_fd" not in data and b"rebuild_storage_fd" in bytes(
        ForkingPickler.dumps(small)
    )
    back = pickle.loads(data)
    assert type(back) is Batch and _same(back, small)
    untargeted = Batch((torch.ones(3),), None)
    several = pickle.loads(ForkingPickler.dumps(by_value([small, untargeted])))
    assert [type(b) for b in several] == [Batch, Batch] and _same(several[0], small)
    assert several[1].targets is None
    # Sent the usual way: too big, a dtype numpy lacks, a tensor that needs grad, not a Batch.
    for value in (
        small,
        Batch((torch.ones(2, dtype=torch.bfloat16),), None),
        Batch((torch.ones(2, requires_grad=True),), None),
        (torch.ones(2),),
        [small, 3],
    ):
        assert by_value(value, 16) is value


@pytest.mark.parametrize("drop_last", [True, False])
def test_tasks_hold_the_batches_a_batch_sampler_makes(drop_last: bool) -> None:
    sampler = SequentialSampler(range(23))
    expected = list(BatchSampler(sampler, batch_size=4, drop_last=drop_last))
    for per_task in (1, 2, 3, 16):
        tasks = Tasks(sampler, batch_size=4, drop_last=drop_last)
        tasks.per_task = per_task
        made = list(tasks)
        assert [b for task in made for b in task] == expected
        assert all(len(task) == per_task for task in made[:-1]) and len(made) == len(tasks)
    # The size may change between tasks (after the first batch): still the same batches.
    tasks = Tasks(sampler, batch_size=4, drop_last=drop_last)
    made = []
    for task in tasks:
        made.append(task)
        tasks.per_task = 3
    assert [len(t) for t in made][:2] == [1, 3] and [b for t in made for b in t] == expected


def test_tasks_fit_as_many_batches_as_a_megabyte_holds() -> None:
    tasks = Tasks(SequentialSampler(range(8)), batch_size=2, drop_last=True)

    def batch(nbytes: int) -> Batch:
        return Batch((torch.zeros(nbytes // 4),), {"x": torch.zeros(0)})  # type: ignore[arg-type]

    for nbytes, per_task in ((36_000, MAX_BATCHES_PER_TASK), (300_000, 3), (2 * BY_VALUE_BYTES, 1)):
        tasks.fit(batch(nbytes))
        assert tasks.per_task == per_task


class Pairs(Dataset):
    def __len__(self) -> int:
        return 50

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.full((3,), float(i)), torch.tensor([float(i % 2)])


@pytest.mark.parametrize("drop_last", [True, False])
def test_workers_give_the_batches_and_epochs_of_the_training_process(drop_last: bool) -> None:
    def batches(workers: int, start: int = 0) -> tuple[list[Batch], int | None]:
        loader = build_loader(
            Pairs(),
            rank=1,
            world_size=2,
            batch_size=4,
            num_workers=workers,
            collate_fn=BatchCollate(),
            seed=7,
            drop_last=drop_last,
        )
        made = list(itertools.islice(loader.batches(start), 20 - start))  # several epochs
        if workers:
            assert loader.tasks is not None and loader.tasks.per_task == MAX_BATCHES_PER_TASK
        return made, loader.steps_per_epoch

    (in_process, per_epoch), (from_workers, worker_epoch) = batches(0), batches(2)
    assert per_epoch == worker_epoch == (6 if drop_last else 7)
    assert len(from_workers) == 20 and all(
        _same(a, b) for a, b in zip(in_process, from_workers, strict=True)
    )
    resumed, _ = batches(2, start=9)
    assert all(_same(a, b) for a, b in zip(in_process[9:], resumed, strict=True))
