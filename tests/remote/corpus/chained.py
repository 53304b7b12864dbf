"""One lookup chained on another: the second table's ids depend on the first table's rows."""

from __future__ import annotations

import torch
import torch.distributed.rpc as rpc
from torch import nn

from tests.remote.corpus import common
from tests.remote.corpus.rpc_utils import _parameter_rrefs, _remote_method
from tests.remote.corpus.tables import DIM, NUM_ROWS, EmbeddingTable


class Model(nn.Module):
    def __init__(self, seed: int = 0, servers=common.SERVERS):
        super().__init__()
        self.emb0_rref = rpc.remote(servers[0], EmbeddingTable, args=(NUM_ROWS, DIM, seed))
        self.emb1_rref = rpc.remote(servers[1], EmbeddingTable, args=(NUM_ROWS, DIM, seed + 1))
        self.tower = common.tower()
        self.head = common.head()

    def forward(self, dense, ids):
        h = self.tower(dense)
        e0 = _remote_method(EmbeddingTable.forward, self.emb0_rref, ids[:, 0])
        ids1 = (ids[:, 1] + e0.argmax(dim=1, keepdim=True)) % NUM_ROWS
        e1 = _remote_method(EmbeddingTable.forward, self.emb1_rref, ids1)
        return self.head(torch.cat([h, e0, e1], dim=1))


class HandAsync(Model):
    def forward(self, dense, ids):
        from tests.remote.corpus.rref_helper import _remote_method_async

        f0 = _remote_method_async(EmbeddingTable.forward, self.emb0_rref, ids[:, 0])
        h = self.tower(dense)
        e0 = f0.wait()
        ids1 = (ids[:, 1] + e0.argmax(dim=1, keepdim=True)) % NUM_ROWS
        e1 = _remote_method(EmbeddingTable.forward, self.emb1_rref, ids1)
        return self.head(torch.cat([h, e0, e1], dim=1))


def build(seed: int = 0, hand: bool = False) -> Model:
    return common.seeded(seed, (HandAsync if hand else Model)(seed))


def remote_parameters(model: Model) -> list:
    return [
        p for r in (model.emb0_rref, model.emb1_rref) for p in _remote_method(_parameter_rrefs, r)
    ]
