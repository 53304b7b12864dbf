"""``pair_user_waits``: waits users wrote on their own async remote calls become the spec's wait op."""

from __future__ import annotations

import pytest
import torch
import torch.distributed.rpc as rpc
from torch import nn

import distopt
from distopt.passes import run_passes
from distopt.passes.core.pass_base import resolve_pipeline
from distopt.remote import register_read, registry
from distopt.remote.wait import is_wait
from tests.passes.remote import inprocess_server as ps
from tests.passes.remote.inprocess_server import STORE, fetch, fetch_async


@pytest.fixture(autouse=True)
def _fresh_store() -> None:
    STORE.reset()


def _inputs() -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(3, ps.DIM), torch.tensor([1, 5, 2])


class WaitsAtOnce(nn.Module):
    """Issues asynchronously, then waits at once with ``fut.wait()``: nothing overlaps yet."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(ps.DIM, ps.DIM)

    def forward(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        fut = fetch_async("t0", ids)
        rows = fut.wait()
        return self.fc(x) + rows


class WaitsAll(nn.Module):
    """``torch.futures.wait_all`` over two issues."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(ps.DIM, ps.DIM)

    def forward(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        r0, r2 = torch.futures.wait_all([fetch_async("t0", ids), fetch_async("t2", ids)])
        return self.fc(x) + r0 * r2


def _waits(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    return [n for n in gm.graph.nodes if is_wait(n)]


def test_a_users_wait_becomes_the_specs_wait_op_and_the_issue_stays() -> None:
    gm = distopt.optimize(WaitsAtOnce(), _inputs(), passes=["pair_user_waits"], strict=True)
    (wait,) = _waits(gm)
    assert wait.target is registry.lookup(fetch).wait_op
    (issue,) = [n for n in gm.graph.nodes if n.target is fetch_async]
    assert wait.args[0] is issue
    assert not [n for n in gm.graph.nodes if n.op == "call_method" and n.target == "wait"]
    assert "rows = fut.wait()" not in gm.code and "fut = fetch_async" in wait.args[1]


def test_wait_all_becomes_one_wait_op_per_issue_in_order() -> None:
    gm = distopt.optimize(WaitsAll(), _inputs(), passes=["pair_user_waits"], strict=True)
    waits = _waits(gm)
    assert [w.args[0].args[0] for w in waits] == ["t0", "t2"]
    assert not [n for n in gm.graph.nodes if n.target is torch.futures.wait_all]


@pytest.mark.parametrize("model_cls", [WaitsAtOnce, WaitsAll])
def test_paired_models_compute_what_the_original_does_and_let_the_issue_move(model_cls) -> None:
    model, inputs = model_cls(), _inputs()
    expected = model(*inputs)
    paired = distopt.optimize(model, inputs, passes=["pair_user_waits"], strict=True)
    torch.testing.assert_close(paired(*inputs), expected)
    # Once paired, the default pipeline schedules the user's issues like the ones split makes.
    scheduled = distopt.optimize(model, inputs, strict=True)
    torch.testing.assert_close(scheduled(*inputs), expected)
    first = next(n for n in scheduled.graph.nodes if n.op == "call_function")
    assert first.target is fetch_async or first.target is ps.fetch_many_async


def test_pairing_is_idempotent() -> None:
    gm = distopt.optimize(WaitsAtOnce(), _inputs(), passes=["pair_user_waits"], strict=True)
    code = gm.code
    record = run_passes(gm, resolve_pipeline(["pair_user_waits"]))
    assert gm.code == code and not record.passes[0].modified


@register_read
def lookup_rows(table: str, ids: torch.Tensor) -> torch.Tensor:
    return torch.zeros(len(ids), ps.DIM)


class RpcAsync(nn.Module):
    """The tutorials' forms: ``rpc_async(...).wait()`` and ``rpc.remote(...).to_here()``."""

    def forward(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        a = rpc.rpc_async("ps0", lookup_rows, args=("t0", ids)).wait()
        b = rpc.remote("ps1", lookup_rows, args=("t1", ids)).to_here()
        return x + a + b


def test_rpc_async_wait_and_remote_to_here_are_paired_without_running_anything() -> None:
    # No example inputs: captured and rewritten only (no RPC group here).
    gm = distopt.optimize(RpcAsync(), passes=["pair_user_waits"], strict=True)
    waits = _waits(gm)
    assert [w.args[0].target for w in waits] == [rpc.rpc_async, rpc.remote]
    assert not [
        n for n in gm.graph.nodes if n.op == "call_method" and n.target in ("wait", "to_here")
    ]
