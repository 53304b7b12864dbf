"""Logged impressions: which user saw which item of which shop, and whether they clicked."""

import torch
from torch.utils.data import Dataset, default_collate

from distopt.data import Batch


class Impressions(Dataset):
    def __init__(self, size, seed):
        gen = torch.Generator().manual_seed(seed)
        self.user = torch.randint(0, 1000, (size,), generator=gen)
        self.item = torch.randint(0, 500, (size,), generator=gen)
        self.shop = self.item % 50
        self.dense = torch.randn(size, 4, generator=gen)
        taste = torch.Generator().manual_seed(1234)  # the same hidden preferences in every split
        item_appeal, shop_appeal = torch.randn(500, generator=taste), torch.randn(50, generator=taste)
        logit = 1.5 * item_appeal[self.item] + shop_appeal[self.shop] + self.dense[:, 0] - 0.5
        self.clicked = (torch.rand(size, generator=gen) < torch.sigmoid(logit)).float()

    def __len__(self):
        return len(self.clicked)

    def __getitem__(self, i):
        return {"dense": self.dense[i], "user": self.user[i], "item": self.item[i],
                "shop": self.shop[i], "clicked": self.clicked[i]}


def collate(rows):
    b = default_collate(rows)
    return Batch((b["dense"], b["user"], b["item"], b["shop"]), b["clicked"].unsqueeze(1))


def make_data(split, seed, size=4096):
    if split == "train":
        return Impressions(size, seed), collate
    return Impressions(size // 4, seed + 1), collate
