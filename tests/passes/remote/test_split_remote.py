import pytest
import torch
import torch.distributed.rpc as rpc
from torch import nn

import distopt
from distopt.capture.tracer import DistoptTracer
from distopt.passes import run_passes
from distopt.passes.core.pass_base import resolve_pipeline
from distopt.remote import register_remote, registry, unregister_remote
from distopt.remote.wait import is_wait
from tests.passes.remote import inprocess_server as ps
from tests.passes.remote.inprocess_server import STORE, fetch, fetch_async, push, push_async


class FetchThenPush(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(ps.DIM, ps.DIM)

    def forward(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        rows = fetch("t0", ids)  # the source line errors quote
        out = self.fc(x) + rows
        push("t1", ids, out)
        return out


@pytest.fixture(autouse=True)
def _fresh_store() -> None:
    STORE.reset()


def _inputs() -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(3, ps.DIM), torch.tensor([1, 5, 2])


WAIT = "wait"
"""Stands for any wait op in :func:`_targets`."""


def _targets(gm: torch.fx.GraphModule) -> list[object]:
    """Remote-call targets in graph order (wait ops as ``WAIT``)."""
    remote = {fetch, push, fetch_async, push_async, ps.fetch_many_async}
    return [
        WAIT if is_wait(n) else n.target
        for n in gm.graph.nodes
        if n.op == "call_function" and (n.target in remote or is_wait(n))
    ]


def test_each_blocking_call_becomes_issue_then_wait() -> None:
    gm = distopt.optimize(FetchThenPush(), _inputs(), passes=["split_remote"], strict=True)
    assert _targets(gm) == [fetch_async, WAIT, push_async, WAIT]
    assert "fetch_wait = " in gm.code and "push_wait = " in gm.code
    # The wait quotes the user's line of the blocking call.
    assert 'rows = fetch("t0", ids)  # the source line errors quote' in gm.code


def test_each_wait_calls_the_wait_op_of_its_own_spec() -> None:
    gm = distopt.optimize(FetchThenPush(), _inputs(), passes=["split_remote"], strict=True)
    waits = {n.name: n.target for n in gm.graph.nodes if is_wait(n)}
    # Bound when the graph was rewritten: no lookup by name while training.
    assert waits["fetch_wait"] is registry.lookup(fetch).wait_op
    assert waits["push_wait"] is registry.lookup(push).wait_op


def test_split_model_computes_the_same_and_applies_the_write() -> None:
    model, inputs = FetchThenPush(), _inputs()
    expected = model(*inputs)
    after_original = STORE.snapshot()
    STORE.reset()
    gm = distopt.optimize(model, inputs, passes=["split_remote"], verify=False, strict=True)
    torch.testing.assert_close(gm(*inputs), expected)
    for table, value in STORE.snapshot().items():
        torch.testing.assert_close(value, after_original[table])


def test_dead_code_elimination_keeps_an_unused_push() -> None:
    gm = distopt.optimize(FetchThenPush(), _inputs(), passes=["split_remote"], strict=True)
    # Running the pipeline again (lint + DCE + recompile after each pass) drops nothing.
    run_passes(gm, resolve_pipeline(["split_remote"]))
    push_issue = next(n for n in gm.graph.nodes if n.target is push_async)
    assert list(push_issue.users) and is_wait(next(iter(push_issue.users)))


def test_server_error_surfaces_at_the_wait_with_message_and_source_line() -> None:
    gm = distopt.optimize(FetchThenPush(), _inputs(), passes=["split_remote"], strict=True)
    STORE.fail["t0"] = "table t0 is being resharded"
    with pytest.raises(distopt.RemoteCallError) as caught:
        gm(*_inputs())
    message = str(caught.value)
    assert "table t0 is being resharded" in message
    assert "test_split_remote.py" in message and 'rows = fetch("t0", ids)' in message
    assert isinstance(caught.value.__cause__, ValueError)


def test_wait_is_a_named_profiler_range() -> None:
    gm = distopt.optimize(FetchThenPush(), _inputs(), passes=["split_remote"], strict=True)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        gm(*_inputs())
    names = [event.name for event in prof.events()]
    assert names.count("distopt.wait:fetch") == 1
    assert names.count("distopt.wait:push") == 1


def test_split_is_idempotent() -> None:
    gm = distopt.optimize(FetchThenPush(), _inputs(), passes=["split_remote"], strict=True)
    code = gm.code
    record = run_passes(gm, resolve_pipeline(["split_remote"]))
    assert gm.code == code and not record.passes[0].modified


def test_retracing_the_split_graph_keeps_issue_and_wait_as_leaves() -> None:
    gm = distopt.optimize(FetchThenPush(), _inputs(), passes=["split_remote"], strict=True)
    STORE.reset()
    graph = DistoptTracer().trace(gm)
    assert STORE.requests == 0  # nothing was sent while tracing
    again = torch.fx.GraphModule(gm, graph)
    assert _targets(again) == [fetch_async, WAIT, push_async, WAIT]
    # The source line travelled as a constant argument.
    assert 'rows = fetch("t0", ids)' in again.code
    run_passes(again, resolve_pipeline(["split_remote"]))
    inputs = _inputs()
    torch.testing.assert_close(again(*inputs), gm(*inputs))


_WAITS: list[str] = []


def scaled_async(x: torch.Tensor) -> torch.futures.Future:
    fut: torch.futures.Future = torch.futures.Future()
    fut.set_result(x * 2)
    return fut


def scaled_wait(fut: torch.futures.Future) -> torch.Tensor:
    _WAITS.append("waited")
    return fut.wait() + 1


def scaled(x: torch.Tensor) -> torch.Tensor:
    return scaled_wait(scaled_async(x))


class Scaled(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return scaled(x) * 3


def test_custom_wait_of_the_spec_is_used() -> None:
    register_remote(scaled, issue=scaled_async, wait=scaled_wait, effect="read")
    try:
        x = torch.randn(2)
        gm = distopt.optimize(Scaled(), (x,), passes=["split_remote"], strict=True)
        assert scaled_async in [n.target for n in gm.graph.nodes]
        _WAITS.clear()
        torch.testing.assert_close(gm(x), (x * 2 + 1) * 3)
        assert _WAITS == ["waited"]
    finally:
        unregister_remote(scaled)


# --- torch.distributed.rpc.rpc_sync is recognized out of the box (a real one-process RPC agent).

_RPC_TABLE = {"w": torch.arange(8.0)}


@distopt.register_read
def rpc_lookup(table: str, ids: torch.Tensor) -> torch.Tensor:
    return _RPC_TABLE[table][ids]


def rpc_bump(table: str, ids: torch.Tensor) -> None:
    _RPC_TABLE[table][ids] += 100


class RpcModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        read = rpc.rpc_sync("worker0", rpc_lookup, args=("w", ids))
        rpc.rpc_sync("worker0", rpc_bump, args=("w", ids))
        again = rpc.rpc_sync("worker0", rpc_lookup, args=("w", ids))
        return h + read + again


@pytest.fixture(scope="module")
def rpc_agent():
    from distopt.dist import rendezvous
    from distopt.ps.spec import ServerOptions

    # Our loopback store: init_rpc's own (tcp:// init) would listen on every interface.
    plan = rendezvous.StorePlan(host="127.0.0.1", hosted_by="worker0", rpc_port=0)
    with rendezvous.host_stores(plan, me="worker0", timeout_s=30.0) as hosted:
        rendezvous.init_rpc(
            hosted.plan,
            name="worker0",
            rank=0,
            world_size=1,
            transport=ServerOptions(),
            timeout_s=30.0,
        )
        try:
            yield
        finally:
            rpc.shutdown()


def test_rpc_sync_is_split_and_its_registered_reads_hoisted(rpc_agent: None) -> None:
    x, ids = torch.randn(3, 3), torch.tensor([0, 2, 4])
    model = RpcModel()
    _RPC_TABLE["w"] = torch.arange(8.0)
    expected = model(x, ids)
    _RPC_TABLE["w"] = torch.arange(8.0)
    gm = distopt.optimize(
        model, (x, ids), passes=["split_remote", "hoist_issue"], verify=False, strict=True
    )
    names = [n.name for n in gm.graph.nodes]
    issues = [n.name for n in gm.graph.nodes if n.target is rpc.rpc_async]
    assert len(issues) == 3 and rpc.rpc_sync not in [n.target for n in gm.graph.nodes]
    first_read, bump, second_read = issues
    # The first read (registered with register_read) moves above the dense layer; the write
    # (an unregistered remote function) and the read after it keep their place.
    assert names.index(first_read) < names.index("fc")
    assert names.index(bump) > names.index("fc")
    assert names.index(f"{bump.removesuffix('_issue')}_wait") < names.index(second_read)
    torch.testing.assert_close(gm(x, ids), expected)
