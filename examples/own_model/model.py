"""Your own model and data, with remote calls written as ``torch.distributed.rpc.rpc_sync``.

A click model whose embedding table lives on a parameter-server process, kept there by the
user's own functions (not distopt's tables): ``lookup`` reads rows, ``apply_gradient`` does an
SGD update, both run on ``ps0`` through plain ``rpc_sync``. The gradient reaches the server from
backward: :func:`push_on_backward` is an identity whose backward sends the rows' gradient.

``lookup`` is declared a read (``@distopt.register_read``), so ``distopt.optimize`` may issue it
early (``rpc_async`` before the dense work, waited right before use) and verification runs it
once and replays it. ``apply_gradient`` is declared a write (``@distopt.register_write``): it is
never sent twice, so verification compares the outputs and leaves out the gradients, whose
backward would send it (``distopt explain`` says so). The job config is
``examples/own_model/job.yaml``: ``model: examples.own_model.model:make_model`` and
``data.source: examples.own_model.model:make_dataset``; ``docs/own_job.md`` walks through it.
"""

from __future__ import annotations

import torch
import torch.distributed.rpc as rpc
import torch.fx
from torch import nn
from torch.utils.data import Dataset

import distopt
from distopt.data import Batch

SERVER = "ps0"  # the job's first parameter server (distopt.ps.server_name(0))
ROWS, DIM = 512, 8
_TABLE: dict[str, torch.Tensor] = {}
"""The table, in the server process (created on first use there)."""


def _table() -> torch.Tensor:
    if "w" not in _TABLE:
        _TABLE["w"] = torch.randn(ROWS, DIM, generator=torch.Generator().manual_seed(0)) * 0.1
    return _TABLE["w"]


@distopt.register_read
def lookup(ids: torch.Tensor) -> torch.Tensor:
    """Runs on the server: rows ``ids``."""
    return _table()[ids]


@distopt.register_write
def apply_gradient(ids: torch.Tensor, grad: torch.Tensor, lr: float) -> None:
    """Runs on the server: an SGD step on rows ``ids`` (duplicates accumulate)."""
    _table().index_add_(0, ids.reshape(-1), grad.reshape(-1, DIM), alpha=-lr)


class _PushOnBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows: torch.Tensor, ids: torch.Tensor, lr: float) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(ids)
        ctx.lr = lr
        return rows.view_as(rows)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        (ids,) = ctx.saved_tensors
        rpc.rpc_sync(SERVER, apply_gradient, args=(ids, grad.float(), ctx.lr))
        return None, None, None


@torch.fx.wrap  # one node in a traced graph: distopt does not look inside
def push_on_backward(rows: torch.Tensor, ids: torch.Tensor, lr: float) -> torch.Tensor:
    """``rows``, with their gradient sent to the server in backward."""
    return _PushOnBackward.apply(rows.requires_grad_(), ids, lr)


class RemoteClickModel(nn.Module):
    """Pooled remote rows and dense features through an MLP to a click logit."""

    host_inputs = (1,)  # ids only address remote rows: keep them in host memory on a GPU

    def __init__(self, dense_features: int = 4, hidden: int = 32, sparse_lr: float = 0.5) -> None:
        super().__init__()
        self.sparse_lr = sparse_lr
        self.dense = nn.Sequential(nn.Linear(dense_features, hidden), nn.ReLU())
        self.top = nn.Sequential(nn.Linear(hidden + DIM, hidden), nn.ReLU(), nn.Linear(hidden, 1))

    def forward(self, dense: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        rows = rpc.rpc_sync(SERVER, lookup, args=(ids,))  # [B, bag, DIM], blocking
        h = self.dense(dense)
        pooled = push_on_backward(rows, ids, self.sparse_lr).sum(dim=1)
        return self.top(torch.cat([h, pooled], dim=1))

    def ps_tables(self) -> list:
        """The job starts parameter-server processes for models that have this; distopt's own
        tables are not used (the user's functions keep the table)."""
        return []


def make_model(
    dense_features: int = 4, hidden: int = 32, sparse_lr: float = 0.5
) -> RemoteClickModel:
    return RemoteClickModel(dense_features, hidden, sparse_lr)


class Clicks(Dataset):
    """``(dense, ids)`` → click: the label follows hidden per-row weights and the dense features."""

    def __init__(self, size: int, *, seed: int, dense_features: int = 4, bag: int = 3) -> None:
        gen = torch.Generator().manual_seed(seed)
        weight = torch.randn(ROWS, generator=torch.Generator().manual_seed(1234))
        self.dense = torch.randn(size, dense_features, generator=gen)
        self.ids = torch.randint(0, ROWS, (size, bag), generator=gen)
        score = weight[self.ids].sum(dim=1) + self.dense[:, 0]
        self.labels = (score + 0.5 * torch.randn(size, generator=gen) > 0).float().unsqueeze(1)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.dense[index], self.ids[index], self.labels[index]

    @staticmethod
    def collate_fn(samples: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> Batch:
        dense, ids, labels = (torch.stack(column) for column in zip(*samples, strict=True))
        return Batch((dense, ids), labels)


def make_dataset(split: str, seed: int, size: int = 4096) -> Clicks:
    """``data.source`` factory: a training set, and a held-out set from another seed."""
    return Clicks(
        size if split == "train" else size // 4, seed=seed if split == "train" else seed + 1
    )
