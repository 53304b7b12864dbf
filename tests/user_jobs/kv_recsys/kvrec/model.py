"""The ranker: three lookups in our store, a dense tower, an MLP head."""

import torch
import torch.distributed.rpc as rpc
import torch.fx
from torch import nn

from kvrec import store

STORE = "ps0"  # the job's first parameter-server process


class _SendGrad(torch.autograd.Function):
    """Identity forward; backward sends an SGD step of the looked-up rows to the store."""

    @staticmethod
    def forward(ctx, rows, name, ids, lr):
        ctx.name, ctx.lr = name, lr
        ctx.save_for_backward(ids)
        return rows.view_as(rows)

    @staticmethod
    def backward(ctx, grad):
        (ids,) = ctx.saved_tensors
        rpc.rpc_sync(STORE, store.add, args=(ctx.name, ids, -ctx.lr * grad))
        return None, None, None, None


@torch.fx.wrap  # one node in distopt's graph: it does not trace into the autograd function
def trained(rows, name, ids, lr):
    return _SendGrad.apply(rows.requires_grad_(), name, ids, lr)


class ShopRanker(nn.Module):
    def __init__(self, hidden=32, table_lr=0.5):
        super().__init__()
        self.table_lr = table_lr
        self.dense = nn.Sequential(nn.Linear(4, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU())
        self.head = nn.Sequential(nn.Linear(hidden + 3 * store.DIM, hidden), nn.ReLU(), nn.Linear(hidden, 1))

    def forward(self, dense, user, item, shop):
        u = rpc.rpc_sync(STORE, store.get, args=("user", user))
        i = rpc.rpc_sync(STORE, store.get, args=("item", item))
        s = rpc.rpc_sync(STORE, store.get, args=("shop", shop))
        h = self.dense(dense)
        lr = self.table_lr
        features = [h, trained(u, "user", user, lr), trained(i, "item", item, lr), trained(s, "shop", shop, lr)]
        return self.head(torch.cat(features, dim=1))

    def ps_tables(self):
        return []  # our store holds the tables; distopt only has to start ps0


def make_model(hidden=32, table_lr=0.5):
    return ShopRanker(hidden, table_lr)
