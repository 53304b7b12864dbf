"""A tiny model with a parameter-server embedding, for the job tests (``tests.training.remote_model:...``)."""

from __future__ import annotations

import torch
import torch.fx
from torch import nn

from distopt.ps import RemoteEmbedding, TableSpec

_CALLS: dict[int, int] = {}
"""Forward calls per model (by ``id``), counted by :func:`_counted`."""


@torch.fx.wrap
def _counted(ids: torch.Tensor, model: int, fail_after: int | None) -> torch.Tensor:
    """Count a forward of ``model`` and fail after ``fail_after`` calls. A leaf function, so the
    model as optimized (a traced graph calls it) counts and fails as the model as written does;
    ``self.calls += 1`` in forward would make distopt refuse the traced graph."""
    calls = _CALLS[model] = _CALLS.get(model, 0) + 1
    if fail_after is not None and calls > fail_after:
        raise RuntimeError(f"injected failure in forward call {calls}")
    return ids


class RemoteMLP(nn.Module):
    """Pooled remote embedding rows through a local linear layer."""

    def __init__(self, rows: int = 64, dim: int = 8, fail_after: int | None = None) -> None:
        super().__init__()
        self.rows, self.dim, self.fail_after = rows, dim, fail_after
        self.emb = RemoteEmbedding("emb", dim, pooling="sum")
        self.fc = nn.Linear(dim, 1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        ids = _counted(ids, id(self), self.fail_after)
        return self.fc(self.emb(ids))

    def ps_tables(self) -> list[TableSpec]:
        return [TableSpec(name="emb", num_rows=self.rows, dim=self.dim)]

    def example_inputs(self, batch_size: int, seed: int) -> tuple[torch.Tensor]:
        gen = torch.Generator().manual_seed(seed)
        return (torch.randint(0, self.rows, (batch_size, 3), generator=gen),)


def remote_mlp(rows: int = 64, dim: int = 8, fail_after: int | None = None) -> RemoteMLP:
    return RemoteMLP(rows, dim, fail_after)
