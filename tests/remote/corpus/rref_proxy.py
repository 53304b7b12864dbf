"""The RRef proxy API: ``self.emb0.rpc_sync().forward(ids)``."""

from __future__ import annotations

import torch
import torch.distributed.rpc as rpc
from torch import nn

from tests.remote.corpus import common
from tests.remote.corpus.tables import DIM, NUM_ROWS, EmbeddingTable


class Model(nn.Module):
    def __init__(self, seed: int = 0, servers=common.SERVERS):
        super().__init__()
        self.emb0 = rpc.remote(servers[0], EmbeddingTable, args=(NUM_ROWS, DIM, seed))
        self.emb1 = rpc.remote(servers[1], EmbeddingTable, args=(NUM_ROWS, DIM, seed + 1))
        self.tower = common.tower()
        self.head = common.head()

    def forward(self, dense, ids):
        h = self.tower(dense)
        e0 = self.emb0.rpc_sync().forward(ids[:, 0])
        e1 = self.emb1.rpc_sync().forward(ids[:, 1])
        return self.head(torch.cat([h, e0, e1], dim=1))


class HandAsync(Model):
    def forward(self, dense, ids):
        f0 = self.emb0.rpc_async().forward(ids[:, 0])
        f1 = self.emb1.rpc_async().forward(ids[:, 1])
        h = self.tower(dense)
        return self.head(torch.cat([h, f0.wait(), f1.wait()], dim=1))


def build(seed: int = 0, hand: bool = False) -> Model:
    return common.seeded(seed, (HandAsync if hand else Model)(seed))


def remote_parameters(model: Model) -> list:
    return [p for r in (model.emb0, model.emb1) for p in r.rpc_sync().parameter_rrefs()]
