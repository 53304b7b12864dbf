"""Loaders placed by rank, endless and resumable (distopt.data.loader)."""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import Dataset, IterableDataset

from distopt.data.loader import build_eval_loader, build_loader, holdout_split
from distopt.data.tokens import TokenFile, TokenWindows, collate_tokens
from distopt.errors import ConfigError


class Numbers(Dataset):
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.tensor(index)


class Counting(IterableDataset):
    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self):
        return iter(torch.arange(self.n))


def _take(batches, n: int) -> list[list[int]]:
    return [b.tolist() for b in itertools.islice(batches, n)]


def test_map_style_ranks_split_each_epoch_and_reshuffle() -> None:
    loaders = [
        build_loader(Numbers(40), rank=r, world_size=2, batch_size=4, seed=5) for r in range(2)
    ]
    assert [loader.steps_per_epoch for loader in loaders] == [5, 5]
    epochs = [[_take(loader.epoch(e), 5) for loader in loaders] for e in (0, 1)]
    for per_rank in epochs:
        seen = sorted(i for batches in per_rank for batch in batches for i in batch)
        assert seen == list(range(40))  # every sample once per epoch over both ranks
    assert epochs[0] != epochs[1]
    again = build_loader(Numbers(40), rank=0, world_size=2, batch_size=4, seed=5)
    assert _take(again.epoch(1), 5) == epochs[1][0]


@pytest.mark.parametrize("num_workers", [0, 2])
def test_map_style_resume_matches_an_uninterrupted_run(num_workers: int) -> None:
    def loader():
        return build_loader(
            Numbers(22), rank=1, world_size=2, batch_size=3, seed=1, num_workers=num_workers
        )

    whole = _take(loader().batches(), 12)  # 3 batches per epoch (drop_last): 4 epochs
    assert (
        _take(build_loader(Numbers(22), rank=1, world_size=2, batch_size=3, seed=1).batches(), 12)
        == whole
    )
    for start in (1, 3, 7):
        assert _take(loader().batches(start), 12 - start) == whole[start:]


def _windows(tmp_path: Path) -> TokenWindows:
    path = tmp_path / "t.bin"
    np.arange(5000, dtype=np.uint16).tofile(path)
    return TokenWindows(TokenFile(path, vocab_size=5000, seq_len=8).region(), seed=2)


def test_streams_are_the_same_for_any_worker_count_and_resume(tmp_path: Path) -> None:
    def starts(num_workers: int, start: int = 0, rank: int = 0) -> list[list[int]]:
        loader = build_loader(
            _windows(tmp_path),
            rank=rank,
            world_size=2,
            batch_size=4,
            num_workers=num_workers,
            collate_fn=collate_tokens,
        )
        return [b.inputs[0][:, 0].tolist() for b in itertools.islice(loader.batches(start), 6)]

    plain = starts(0)
    assert starts(2) == plain
    assert starts(0, start=2) == starts(2, start=2) == plain[2:] + starts(0, start=6)[:2]
    assert starts(0, rank=1) != plain
    # Batch b of rank r holds windows b * batch_size + i of that rank's stream.
    windows = _windows(tmp_path)
    assert plain[1] == [int(windows.item(0, 4 + i)[0][0]) for i in range(4)]


def test_other_iterables_are_split_between_ranks_and_workers() -> None:
    shares = []
    for rank in range(2):
        loader = build_loader(Counting(24), rank=rank, world_size=2, batch_size=2, num_workers=2)
        shares.append(_take(loader.batches(), 6))
    flat = sorted(i for share in shares for batch in share for i in batch)
    assert flat == list(range(24))
    resumed = build_loader(Counting(24), rank=1, world_size=2, batch_size=2, num_workers=2)
    assert _take(resumed.batches(4), 4) == (shares[1] + shares[1])[4:8]
    assert resumed.steps_per_epoch is None


def test_eval_loader_reads_every_sample_once_without_padding() -> None:
    seen = []
    for rank in range(3):
        loader = build_eval_loader(Numbers(10), rank=rank, world_size=3, batch_size=2)
        seen += [i for batch in loader for i in batch.tolist()]
    assert sorted(seen) == list(range(10))
    iterable = [
        i
        for r in range(3)
        for b in build_eval_loader(Counting(10), rank=r, world_size=3, batch_size=4)
        for i in b.tolist()
    ]
    assert sorted(iterable) == list(range(10))


def test_holdout_split_keeps_the_tail() -> None:
    train, held = holdout_split(Numbers(10), 0.3)
    assert list(train.indices) == list(range(7)) and list(held.indices) == [7, 8, 9]
    with pytest.raises(
        ConfigError, match=r"^data.holdout_fraction: 0.01 of 10 samples leaves 0 held out"
    ):
        holdout_split(Numbers(10), 0.01)


def test_errors_and_options() -> None:
    with pytest.raises(
        ConfigError, match=r"^data: 5 samples give no full batch of 4 on each of 2 trainers"
    ):
        build_loader(Numbers(5), world_size=2, rank=0, batch_size=4)
    with pytest.raises(ConfigError, match=r"^data: rank 2 outside 0..1$"):
        build_loader(Numbers(5), world_size=2, rank=2, batch_size=1)
    with pytest.raises(ConfigError, match=r"^data: TokenWindows is endless"):
        build_eval_loader(TokenWindows.__new__(TokenWindows), batch_size=1)
    loader = build_loader(Numbers(8), batch_size=2, pin_memory=True, num_workers=1)
    assert loader.loader is not None
    assert (
        loader.loader.pin_memory is torch.cuda.is_available() and loader.loader.persistent_workers
    )


def test_workers_send_default_collated_batches_unchanged() -> None:
    loader = build_loader(Numbers(12), batch_size=3, num_workers=2, seed=0)
    with_workers = _take(loader.batches(), 4)
    assert with_workers == _take(build_loader(Numbers(12), batch_size=3, seed=0).batches(), 4)
