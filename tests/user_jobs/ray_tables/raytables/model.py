import ray
import torch
import torch.fx
from torch import nn

from raytables.shards import Shard, connect


class _Update(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows, shard, ids, lr):
        ctx.shard, ctx.lr = shard, lr
        ctx.save_for_backward(ids)
        return rows.view_as(rows)

    @staticmethod
    def backward(ctx, grad):
        (ids,) = ctx.saved_tensors
        ray.get(ctx.shard.apply.remote(ids, grad, ctx.lr))
        return None, None, None, None


@torch.fx.wrap
def learned(rows, shard, ids, lr):
    return _Update.apply(rows.requires_grad_(), shard, ids, lr)


class TwoTower(nn.Module):
    def __init__(self, dim=8, lr=0.5):
        super().__init__()
        connect()
        self.users = Shard.remote(400, dim, 0)
        self.items = Shard.remote(300, dim, 1)
        self.lr = lr
        self.tower = nn.Sequential(nn.Linear(3, 16), nn.ReLU())
        self.head = nn.Linear(16 + 2 * dim, 1)

    def forward(self, dense, user, item):
        u = ray.get(self.users.lookup.remote(user))
        i = ray.get(self.items.lookup.remote(item))
        h = self.tower(dense)
        return self.head(torch.cat([h, learned(u, self.users, user, self.lr),
                                    learned(i, self.items, item, self.lr)], dim=1))


def two_tower():
    return TwoTower()


class Pairs(torch.utils.data.Dataset):
    def __init__(self, n, seed):
        g = torch.Generator().manual_seed(seed)
        self.dense = torch.randn(n, 3, generator=g)
        self.user = torch.randint(0, 400, (n,), generator=g)
        self.item = torch.randint(0, 300, (n,), generator=g)
        like = torch.randn(300, generator=torch.Generator().manual_seed(5))
        self.label = (like[self.item] + self.dense[:, 0] > 0).float()

    def __len__(self):
        return len(self.label)

    def __getitem__(self, i):
        return self.dense[i], self.user[i], self.item[i], self.label[i]


def pairs(split, seed):
    from distopt.data import Batch

    def collate(rows):
        dense, user, item, label = (torch.stack(c) for c in zip(*rows, strict=True))
        return Batch((dense, user, item), label.unsqueeze(1))

    return Pairs(2048 if split == "train" else 512, seed + (split != "train")), collate
