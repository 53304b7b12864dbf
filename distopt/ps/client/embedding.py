"""``RemoteEmbedding``: an embedding whose rows live on the parameter servers."""

from __future__ import annotations

from typing import Literal

import torch
from torch import nn

from distopt.config import check
from distopt.ps.client.calls import fetch


class RemoteEmbedding(nn.Module):
    """Looks up rows of parameter-server table ``table`` with a blocking fetch, as users write it.

    ``forward(ids)`` returns ``[*ids.shape, dim]`` rows, or with ``pooling`` ("sum"/"mean") the bag
    of the last id dimension reduced: ``[*ids.shape[:-1], dim]``. The module holds no parameters;
    the fetched rows are leaves whose gradients ``distopt.ps.push_gradients`` sends back.
    """

    def __init__(
        self, table: str, dim: int, *, pooling: Literal["sum", "mean"] | None = None
    ) -> None:
        super().__init__()
        check(
            isinstance(table, str) and bool(table), "RemoteEmbedding.table", "a table name", table
        )
        check(dim >= 1, "RemoteEmbedding.dim", "an integer >= 1", dim)
        check(
            pooling in (None, "sum", "mean"),
            "RemoteEmbedding.pooling",
            "None, 'sum' or 'mean'",
            pooling,
        )
        self.table = table
        self.dim = dim
        self.pooling = pooling

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = fetch(self.table, ids)
        if self.pooling == "sum":
            return rows.sum(dim=-2)
        if self.pooling == "mean":
            return rows.mean(dim=-2)
        return rows

    def extra_repr(self) -> str:
        return f"table={self.table!r}, dim={self.dim}, pooling={self.pooling!r}"
