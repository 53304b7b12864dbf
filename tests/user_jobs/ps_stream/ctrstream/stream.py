"""A click stream read once per pass, as events arrive: an IterableDataset of dicts."""

import torch
from torch.utils.data import IterableDataset

from ctrstream.model import N_ADS, N_QUERIES
from distopt.data import Batch


class ClickStream(IterableDataset):
    def __init__(self, events: int, seed: int) -> None:
        self.events, self.seed = events, seed

    def __iter__(self):
        gen = torch.Generator().manual_seed(self.seed)
        quality = torch.randn(N_ADS, generator=torch.Generator().manual_seed(99))
        for _ in range(self.events):
            ads = torch.randint(0, N_ADS, (2,), generator=gen)
            queries = torch.randint(0, N_QUERIES, (3,), generator=gen)
            numeric = torch.randn(6, generator=gen)
            p = torch.sigmoid(quality[ads].sum() + numeric[0] - 0.3)
            yield {"numeric": numeric, "ads": ads, "queries": queries,
                   "click": (torch.rand((), generator=gen) < p).float()}

    @staticmethod
    def collate_fn(events):
        stack = lambda key: torch.stack([e[key] for e in events])  # noqa: E731
        return Batch((stack("numeric"), stack("ads"), stack("queries")), stack("click").unsqueeze(-1))


def clicks(split: str, seed: int, events: int = 6000) -> ClickStream:
    return ClickStream(events, seed) if split == "train" else ClickStream(events // 5, seed + 7)
