"""The DDP+RPC example's style: tables as ``torch.distributed.nn.RemoteModule``."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.nn import RemoteModule

from tests.remote.corpus import common
from tests.remote.corpus.tables import DIM, NUM_ROWS, EmbeddingTable


class Model(nn.Module):
    def __init__(self, seed: int = 0, servers=common.SERVERS):
        super().__init__()
        self.emb0 = RemoteModule(f"{servers[0]}/cpu", EmbeddingTable, args=(NUM_ROWS, DIM, seed))
        self.emb1 = RemoteModule(
            f"{servers[1]}/cpu", EmbeddingTable, args=(NUM_ROWS, DIM, seed + 1)
        )
        self.tower = common.tower()
        self.head = common.head()

    def forward(self, dense, ids):
        h = self.tower(dense)
        e0 = self.emb0(ids[:, 0])
        e1 = self.emb1(ids[:, 1])
        return self.head(torch.cat([h, e0, e1], dim=1))


class HandAsync(Model):
    def forward(self, dense, ids):
        f0 = self.emb0.forward_async(ids[:, 0])
        f1 = self.emb1.forward_async(ids[:, 1])
        h = self.tower(dense)
        return self.head(torch.cat([h, f0.wait(), f1.wait()], dim=1))


def build(seed: int = 0, hand: bool = False) -> Model:
    model = (HandAsync if hand else Model)(seed)
    # RemoteModule refuses parameters(): seed the local modules one by one.
    common.seeded(seed, model.tower)
    common.seeded(seed + 100, model.head)
    return model


def remote_parameters(model: Model) -> list:
    return [*model.emb0.remote_parameters(), *model.emb1.remote_parameters()]
