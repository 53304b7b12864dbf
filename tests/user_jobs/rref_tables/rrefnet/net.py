"""The RPC tutorials' style: the embedding is a RemoteModule living on the server process."""

import torch
from torch import nn
from torch.distributed.nn import RemoteModule


class Net(nn.Module):
    def __init__(self, rows=1000, dim=16):
        super().__init__()
        self.emb = RemoteModule("ps0/cpu", nn.EmbeddingBag, args=(rows, dim), kwargs={"mode": "sum"})
        self.fc = nn.Sequential(nn.Linear(dim + 4, 32), nn.ReLU(), nn.Linear(32, 1))

    def forward(self, x, ids):
        e = self.emb(ids)
        return self.fc(torch.cat([x, e], dim=1))

    def ps_tables(self):
        return []  # the RemoteModule lives on ps0; no distopt tables


def make_net():
    return Net()


def make_data(seed):
    gen = torch.Generator().manual_seed(seed)
    x, ids = torch.randn(2048, 4, generator=gen), torch.randint(0, 1000, (2048, 3), generator=gen)
    y = (x[:, :1] + 0.3 * torch.randn(2048, 1, generator=gen) > 0).float()
    return torch.utils.data.TensorDataset(x, ids, y), collate


def collate(rows):
    from distopt.data import Batch

    x, ids, y = (torch.stack(c) for c in zip(*rows, strict=True))
    return Batch((x, ids), y)
