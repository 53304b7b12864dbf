"""Wide & deep CTR model; the sparse tables are distopt parameter-server tables."""

import torch
from torch import nn

from distopt.ps import RemoteEmbedding, TableSpec

N_ADS, N_QUERIES, DIM = 3000, 800, 8


class WideDeep(nn.Module):
    def __init__(self, hidden: int = 32) -> None:
        super().__init__()
        self.ads = RemoteEmbedding("ads", DIM, pooling="sum")
        self.queries = RemoteEmbedding("queries", DIM, pooling="mean")
        self.deep = nn.Sequential(nn.Linear(6, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU())
        self.out = nn.Linear(hidden + 2 * DIM, 1)

    def forward(self, numeric: torch.Tensor, ad_ids: torch.Tensor, query_ids: torch.Tensor) -> torch.Tensor:
        ad = self.ads(ad_ids)
        query = self.queries(query_ids)
        deep = self.deep(numeric)
        return self.out(torch.cat([deep, ad, query], dim=-1))

    def ps_tables(self) -> list[TableSpec]:
        return [TableSpec(name="ads", num_rows=N_ADS, dim=DIM, optimizer="adagrad"),
                TableSpec(name="queries", num_rows=N_QUERIES, dim=DIM)]


def build(hidden: int = 32) -> WideDeep:
    return WideDeep(hidden)
