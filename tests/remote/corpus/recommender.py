"""A recommender in the RPC tutorials' style: six remote tables on two servers, a tower per table,
one lookup chained on another (the sixth table is indexed by the first table's rows)."""

from __future__ import annotations

import torch
import torch.distributed.rpc as rpc
from torch import nn

from tests.remote.corpus import common
from tests.remote.corpus.rpc_utils import _parameter_rrefs, _remote_method
from tests.remote.corpus.rref_helper import _remote_method_async
from tests.remote.corpus.tables import DIM, NUM_ROWS, EmbeddingTable

TABLES = 6


def _tower() -> nn.Sequential:
    return nn.Sequential(nn.Linear(common.DENSE, 128), nn.ReLU(), nn.Linear(128, DIM))


class Model(nn.Module):
    def __init__(self, seed: int = 0, servers=common.SERVERS):
        super().__init__()
        self.tables = [
            rpc.remote(servers[k % len(servers)], EmbeddingTable, args=(NUM_ROWS, DIM, seed + k))
            for k in range(TABLES)
        ]
        self.towers = nn.ModuleList([_tower() for _ in range(TABLES)])
        self.head = nn.Linear(TABLES * DIM, 1)

    def forward(self, dense, ids):
        features = []
        first = None
        for k in range(TABLES):
            t = self.towers[k](dense)
            if k < TABLES - 1:
                e = _remote_method(EmbeddingTable.forward, self.tables[k], ids[:, k % 2])
            else:  # chained: indexed by the first table's rows
                chained = (ids[:, 1] + first.argmax(dim=1, keepdim=True)) % NUM_ROWS
                e = _remote_method(EmbeddingTable.forward, self.tables[k], chained)
            if k == 0:
                first = e
            features.append(t * e)
        return self.head(torch.cat(features, dim=1))


class HandAsync(Model):
    def forward(self, dense, ids):
        futures = [
            _remote_method_async(EmbeddingTable.forward, self.tables[k], ids[:, k % 2])
            for k in range(TABLES - 1)
        ]
        towers = [self.towers[k](dense) for k in range(TABLES)]
        first = futures[0].wait()
        chained = (ids[:, 1] + first.argmax(dim=1, keepdim=True)) % NUM_ROWS
        last = _remote_method_async(EmbeddingTable.forward, self.tables[-1], chained)
        rows = [first] + [f.wait() for f in futures[1:]] + [last.wait()]
        return self.head(torch.cat([t * e for t, e in zip(towers, rows, strict=True)], dim=1))


def build(seed: int = 0, hand: bool = False) -> Model:
    return common.seeded(seed, (HandAsync if hand else Model)(seed))


def remote_parameters(model: Model) -> list:
    return [p for r in model.tables for p in _remote_method(_parameter_rrefs, r)]
