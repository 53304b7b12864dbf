"""Opening a job's data for its model (distopt.data.build)."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch
from torch.utils.data import Dataset, IterableDataset

from distopt import models
from distopt.data import Batch, DataConfig, build_data
from distopt.data.generate import write_criteo, write_tokens
from distopt.errors import ConfigError
from distopt.models.dlrm import DLRMConfig


class Pairs(Dataset):
    def __len__(self) -> int:
        return 10

    def __getitem__(self, i: int):
        return torch.full((2,), float(i)), torch.tensor([float(i % 2)])


def make_pairs() -> Pairs:
    return Pairs()


def make_split(split: str):
    return Pairs() if split == "train" else None


class Stream(IterableDataset):
    def __iter__(self):
        return iter(torch.arange(6.0).reshape(6, 1))


def make_stream() -> Stream:
    return Stream()


class HasConfig(torch.nn.Module):
    def __init__(self, **kwargs) -> None:
        super().__init__()
        self.config = DLRMConfig(**kwargs)


def test_criteo_reads_shapes_from_the_model_and_splits_the_tail(tmp_path: Path) -> None:
    path = write_criteo(tmp_path / "c.tsv", num_samples=40)
    model = HasConfig(num_tables=2, num_rows=50, bag_size=13)
    data = build_data(
        DataConfig(source="criteo", path=str(path), holdout_fraction=0.25),
        model_name="dlrm",
        model=model,
        batch_size=4,
        seed=0,
    )
    assert (
        data.task == "click"
        and len(data.train) == 30
        and list(data.eval.indices) == list(range(30, 40))
    )
    batch = next(data.train_loader(rank=1, world_size=2, batch_size=4, seed=0).batches())
    assert isinstance(batch, Batch) and batch.inputs[1].shape == (2, 4, 13)
    assert sum(len(b.targets) for b in data.eval_loader(rank=0, world_size=2, batch_size=3)) == 5
    with pytest.raises(ConfigError, match=r"need bag_size >= 13 \(the model's bag_size is 4\)"):
        build_data(
            DataConfig(source="criteo", path=str(path)),
            model_name="dlrm",
            model=HasConfig(num_tables=2),
            batch_size=4,
            seed=0,
        )
    with pytest.raises(ConfigError, match=r"^data.eval_path: file not found: .*missing.tsv$"):
        build_data(
            DataConfig(source="criteo", path=str(path), eval_path=str(tmp_path / "missing.tsv")),
            model_name="dlrm",
            model=HasConfig(num_tables=2, bag_size=13),
            batch_size=4,
            seed=0,
        )
    with pytest.raises(
        ConfigError, match=r"^data.source: criteo data needs a model with an integer 'num_tables'"
    ):
        build_data(
            DataConfig(source="criteo", path=str(path)),
            model_name="mlp",
            model=models.build("mlp"),
            batch_size=4,
            seed=0,
        )


def test_tokens_use_the_models_vocabulary_and_window(tmp_path: Path) -> None:
    path = write_tokens(tmp_path / "t.bin", num_tokens=2000, vocab_size=64)
    model = models.build("gpt", vocab_size=64, seq_len=16)
    data = build_data(
        DataConfig(source="tokens", path=str(path), eval_path=str(path)),
        model_name="gpt",
        model=model,
        batch_size=4,
        seed=0,
    )
    batch = next(data.train_loader(rank=0, world_size=1, batch_size=4, seed=0).batches())
    assert batch.inputs[0].shape == batch.targets.shape == (4, 16)
    assert len(data.eval) == (2000 - 1) // 16
    with pytest.raises(ConfigError, match=r"token id \d+ at position \d+ is >= vocab_size 8"):
        build_data(
            DataConfig(source="tokens", path=str(path)),
            model_name="gpt",
            model=models.build("gpt", vocab_size=8, seq_len=16),
            batch_size=4,
            seed=0,
        )


def test_synthetic_is_todays_data() -> None:
    model = models.build("mlp")
    data = build_data(DataConfig(), model_name="mlp", model=model, batch_size=6, seed=1)
    assert data.batched and data.eval is None and data.task == "none"
    batches = list(
        itertools.islice(data.train_loader(rank=0, world_size=1, batch_size=6, seed=1).batches(), 5)
    )
    assert batches[0].inputs[0].shape[0] == 6 and torch.equal(
        batches[4].inputs[0], batches[0].inputs[0]
    )


def test_factories_split_and_batch() -> None:
    here = __name__
    data = build_data(
        DataConfig(source=f"{here}:make_pairs", holdout_fraction=0.2, task="click"),
        model_name="m",
        model=torch.nn.Linear(2, 1),
        batch_size=2,
        seed=0,
    )
    assert len(data.train) == 8 and len(data.eval) == 2 and data.task == "click"
    batch = next(iter(data.eval_loader(rank=0, world_size=1, batch_size=2)))
    # default_collate of (x, y) samples is a list: taken as the model's positional inputs.
    assert isinstance(batch, Batch) and len(batch.inputs) == 2 and batch.targets is None
    split = build_data(
        DataConfig(source=f"{here}:make_split"),
        model_name="m",
        model=torch.nn.Linear(2, 1),
        batch_size=2,
        seed=0,
    )
    assert split.eval is None and len(split.train) == 10
    with pytest.raises(
        ConfigError, match=r"^data.holdout_fraction: .*make_stream' returned an IterableDataset"
    ):
        build_data(
            DataConfig(source=f"{here}:make_stream", holdout_fraction=0.5),
            model_name="m",
            model=torch.nn.Linear(1, 1),
            batch_size=2,
            seed=0,
        )
