"""A tiny model with a parameter-server embedding, for the job tests (``tests.training.remote_model:...``)."""

from __future__ import annotations

import torch
from torch import nn

from distopt.ps import RemoteEmbedding, TableSpec


class RemoteMLP(nn.Module):
    """Pooled remote embedding rows through a local linear layer."""

    def __init__(self, rows: int = 64, dim: int = 8, fail_after: int | None = None) -> None:
        super().__init__()
        self.rows, self.dim, self.fail_after, self.calls = rows, dim, fail_after, 0
        self.emb = RemoteEmbedding("emb", dim, pooling="sum")
        self.fc = nn.Linear(dim, 1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.fail_after is not None and self.calls > self.fail_after:
            raise RuntimeError(f"injected failure in forward call {self.calls}")
        return self.fc(self.emb(ids))

    def ps_tables(self) -> list[TableSpec]:
        return [TableSpec(name="emb", num_rows=self.rows, dim=self.dim)]

    def example_inputs(self, batch_size: int, seed: int) -> tuple[torch.Tensor]:
        gen = torch.Generator().manual_seed(seed)
        return (torch.randint(0, self.rows, (batch_size, 3), generator=gen),)


def remote_mlp(rows: int = 64, dim: int = 8, fail_after: int | None = None) -> RemoteMLP:
    return RemoteMLP(rows, dim, fail_after)
