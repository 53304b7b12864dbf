"""``rpc.rpc_sync("ps0", lookup, args=(table_name, ids))``: tables addressed by name."""

from __future__ import annotations

import torch
import torch.distributed.rpc as rpc
from torch import nn

from tests.remote.corpus import common
from tests.remote.corpus.tables import create_table, lookup_rows


class Model(nn.Module):
    def __init__(self, seed: int = 0, servers=common.SERVERS):
        super().__init__()
        self.servers = servers
        for i, server in enumerate(servers):
            rpc.rpc_sync(server, create_table, args=(f"t{i}", seed + i))
        self.tower = common.tower()
        self.head = common.head()

    def forward(self, dense, ids):
        h = self.tower(dense)
        e0 = rpc.rpc_sync(self.servers[0], lookup_rows, args=("t0", ids[:, 0]))
        e1 = rpc.rpc_sync(self.servers[1], lookup_rows, args=("t1", ids[:, 1]))
        return self.head(torch.cat([h, e0, e1], dim=1))


class HandAsync(Model):
    def forward(self, dense, ids):
        f0 = rpc.rpc_async(self.servers[0], lookup_rows, args=("t0", ids[:, 0]))
        f1 = rpc.rpc_async(self.servers[1], lookup_rows, args=("t1", ids[:, 1]))
        h = self.tower(dense)
        return self.head(torch.cat([h, f0.wait(), f1.wait()], dim=1))


def build(seed: int = 0, hand: bool = False) -> Model:
    return common.seeded(seed, (HandAsync if hand else Model)(seed))


def remote_parameters(model: Model) -> list:
    return []
