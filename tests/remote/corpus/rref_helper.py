"""The parameter-server tutorial's style: tables held through RRefs, called with
``_remote_method(EmbeddingTable.forward, rref, ids)`` helpers from another module."""

from __future__ import annotations

import torch
import torch.distributed.rpc as rpc
from torch import nn

from tests.remote.corpus import common
from tests.remote.corpus.rpc_utils import _call_method, _parameter_rrefs, _remote_method
from tests.remote.corpus.tables import DIM, NUM_ROWS, EmbeddingTable


class Model(nn.Module):
    def __init__(self, seed: int = 0, servers=common.SERVERS, table_cls=EmbeddingTable):
        super().__init__()
        self.emb0_rref = rpc.remote(servers[0], table_cls, args=(NUM_ROWS, DIM, seed))
        self.emb1_rref = rpc.remote(servers[1], table_cls, args=(NUM_ROWS, DIM, seed + 1))
        self.tower = common.tower()
        self.head = common.head()

    def forward(self, dense, ids):
        h = self.tower(dense)
        e0 = _remote_method(EmbeddingTable.forward, self.emb0_rref, ids[:, 0])
        e1 = _remote_method(EmbeddingTable.forward, self.emb1_rref, ids[:, 1])
        return self.head(torch.cat([h, e0, e1], dim=1))


def _remote_method_async(method, rref, *args, **kwargs):
    args = [method, rref] + list(args)
    return rpc.rpc_async(rref.owner(), _call_method, args=args, kwargs=kwargs)


class HandAsync(Model):
    def forward(self, dense, ids):
        f0 = _remote_method_async(EmbeddingTable.forward, self.emb0_rref, ids[:, 0])
        f1 = _remote_method_async(EmbeddingTable.forward, self.emb1_rref, ids[:, 1])
        h = self.tower(dense)
        return self.head(torch.cat([h, f0.wait(), f1.wait()], dim=1))


def build(seed: int = 0, hand: bool = False) -> Model:
    return common.seeded(seed, (HandAsync if hand else Model)(seed))


def remote_parameters(model: Model) -> list:
    return [
        p for r in (model.emb0_rref, model.emb1_rref) for p in _remote_method(_parameter_rrefs, r)
    ]
