"""Small models with remote calls to the in-process server, and their graphs before/after."""

from __future__ import annotations

import torch
import torch.fx
from torch import nn

import distopt
from distopt.capture import symbolic_capture
from distopt.config import CaptureConfig
from tests.passes.remote import inprocess_server as ps
from tests.passes.remote.inprocess_server import fetch, push, push_async

PASSES = ["split_remote", "hoist_issue", "batch_fetch", "sink_wait"]


class Overlappable(nn.Module):
    """Two fetches (t0, t2: two servers) written right before their use, after a dense tower."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(ps.DIM, ps.DIM)
        self.fc2 = nn.Linear(ps.DIM, ps.DIM)

    def forward(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        h = self.fc2(torch.relu(self.fc1(x)))
        a = fetch("t0", ids)
        b = fetch("t2", ids)
        return h + a + b


class Stateful(nn.Module):
    """Dropout (draws from the RNG stream) and BatchNorm (updates buffers) around one fetch."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.BatchNorm1d(ps.DIM)
        self.drop = nn.Dropout(0.5)

    def forward(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return self.drop(self.norm(x)) + fetch("t0", ids)


class _PushOnBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(ids)
        return rows.view_as(rows)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        push("t1", ctx.saved_tensors[0], grad)
        return None, None


@torch.fx.wrap
def pushed(rows: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """``rows``, whose gradient backward pushes to ``t1`` (a write outside the graph)."""
    return _PushOnBackward.apply(rows.requires_grad_(), ids)


class PushesInBackward(nn.Module):
    """Reads ``t1`` in the forward; its backward pushes the rows' gradient (the user's own table)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(ps.DIM, ps.DIM)

    def forward(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return self.fc(x) + pushed(fetch("t1", ids), ids)


class _IssuePushOnBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(ids)
        return rows.view_as(rows)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        push_async("t1", ctx.saved_tensors[0], grad).wait()
        return None, None


@torch.fx.wrap
def push_issued(rows: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """``rows``, whose gradient backward issues as a push to ``t1`` and waits for."""
    return _IssuePushOnBackward.apply(rows.requires_grad_(), ids)


class IssuesPushInBackward(nn.Module):
    """As :class:`PushesInBackward`, but its backward issues the push (an async write)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(ps.DIM, ps.DIM)

    def forward(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return self.fc(x) + push_issued(fetch("t1", ids), ids)


def inputs() -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(3, ps.DIM), torch.tensor([1, 2, 3])


def graphs() -> tuple[
    nn.Module, torch.fx.GraphModule, torch.fx.GraphModule, tuple[torch.Tensor, ...]
]:
    """The model, its captured graph (blocking fetches), the optimized graph, example inputs."""
    model = Overlappable()
    example = inputs()
    before = symbolic_capture(model, CaptureConfig())
    after = distopt.optimize(model, example, passes=PASSES, strict=True)
    assert isinstance(after, torch.fx.GraphModule)
    return model, before, after, example


def local_nodes(gm: torch.fx.GraphModule) -> set[str]:
    """Nodes that are neither inputs/outputs nor in-process server calls (before the passes)."""
    return {
        n.name
        for n in gm.graph.nodes
        if n.op not in ("placeholder", "output") and n.target is not fetch
    }
