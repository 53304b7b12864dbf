"""A user's dataset may call its columns anything: ``item`` (the most common column of
recommendation data) included. Only a subclass of ``distopt.data.IndexedStream`` is read as an
indexed stream; before, any dataset with an ``item`` attribute was, and every trainer failed with
``TypeError: 'Tensor' object is not callable`` in the loader."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from distopt.cli import main
from distopt.metrics import load_run

PACKAGE = """
import torch
from torch import nn
from torch.utils.data import Dataset, IterableDataset

from distopt.data import Batch


class Basket(Dataset):
    def __init__(self, size=256):
        gen = torch.Generator().manual_seed(0)
        self.user = torch.randint(0, 10, (size,), generator=gen)
        self.item = torch.randint(0, 20, (size,), generator=gen)
        self.shop = self.item % 4
        self.bought = (self.item < 10).float()

    def __len__(self):
        return len(self.bought)

    def __getitem__(self, i):
        return self.user[i], self.item[i], self.shop[i], self.bought[i]


class BasketStream(IterableDataset):
    item = 3  # an attribute named item, on an iterable dataset

    def __iter__(self):
        return iter(Basket())


def collate(rows):
    user, item, shop, bought = (torch.stack(c) for c in zip(*rows, strict=True))
    return Batch((user, item, shop), bought.unsqueeze(1))


def baskets():
    return Basket(), collate


def stream():
    return BasketStream(), collate


class Scorer(nn.Module):
    def __init__(self):
        super().__init__()
        self.user, self.item, self.shop = nn.Embedding(10, 4), nn.Embedding(20, 4), nn.Embedding(4, 4)
        self.out = nn.Linear(12, 1)

    def forward(self, user, item, shop):
        return self.out(torch.cat([self.user(user), self.item(item), self.shop(shop)], dim=1))


def scorer():
    return Scorer()
"""


@pytest.mark.parametrize("source", ["baskets", "stream"])
def test_a_dataset_with_an_item_column_trains(
    source: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "shopdata.py").write_text(textwrap.dedent(PACKAGE))
    monkeypatch.chdir(tmp_path)  # as a user runs it: the module next to the job config
    config = tmp_path / "job.yaml"
    config.write_text(
        f"model: shopdata:scorer\nsteps: 12\nbatch_size: 16\noutput_dir: {tmp_path / 'runs'}\n"
        f"run_id: r\ndata: {{source: 'shopdata:{source}', task: click}}\n"
    )
    assert main(["train", "--config", str(config)]) == 0
    losses = [s.loss for s in load_run(tmp_path / "runs" / "r").ranks[0].steps]
    assert len(losses) == 12 and losses[-1] < losses[0]
