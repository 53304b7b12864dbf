import torch
import torch.fx
from torch import nn

import distopt
from distopt.capture import DistoptTracer
from distopt.remote import register_remote, unregister_remote

CALLS: list[str] = []


def blocking_lookup(key: str, ids: torch.Tensor) -> torch.Tensor:
    CALLS.append(key)
    return ids.float() * 2


def lookup_async(key: str, ids: torch.Tensor) -> torch.futures.Future:
    fut: torch.futures.Future = torch.futures.Future()
    fut.set_result(blocking_lookup(key, ids))
    return fut


class UsesRemote(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        const_ids = torch.arange(4)  # no traced input: a naive wrap would execute the call
        rows = blocking_lookup("table", const_ids)
        return self.fc(x) + rows


class Inner(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x).relu()


class Outer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = Inner()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x) * 2


def test_registered_remote_call_is_one_leaf_node_and_never_runs_while_tracing() -> None:
    register_remote(blocking_lookup, issue=lookup_async, effect="read")
    try:
        CALLS.clear()
        graph = DistoptTracer().trace(UsesRemote())
        assert CALLS == []
        targets = [n.target for n in graph.nodes if n.op == "call_function"]
        assert blocking_lookup in targets
    finally:
        unregister_remote(blocking_lookup)


def test_rpc_sync_is_a_leaf_out_of_the_box() -> None:
    import torch.distributed.rpc as rpc

    class M(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return rpc.rpc_sync("ps0", torch.add, args=(x, 1))

    graph = DistoptTracer().trace(M())
    assert [n.target for n in graph.nodes if n.op == "call_function"] == [rpc.rpc_sync]
    # The patch is undone after tracing.
    assert rpc.rpc_sync.__module__ == "torch.distributed.rpc.api"


def test_leaf_modules_by_class_name_and_by_path() -> None:
    by_class = DistoptTracer(leaf_modules=[f"{__name__}.Inner"]).trace(Outer())
    by_path = DistoptTracer(leaf_modules=["inner"]).trace(Outer())
    for graph in (by_class, by_path):
        assert [n.target for n in graph.nodes if n.op == "call_module"] == ["inner"]


def test_leaf_functions_are_recorded_not_traced() -> None:
    gm = distopt.optimize(
        UsesRemoteFree(), config={"capture": {"leaf_functions": [f"{__name__}.helper"]}}
    )
    assert helper in [n.target for n in gm.graph.nodes]


def helper(x: torch.Tensor) -> torch.Tensor:
    return x.sin().cos()


class UsesRemoteFree(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return helper(x) + 1


def test_retracing_an_optimized_graph_keeps_remote_leaves() -> None:
    register_remote(blocking_lookup, issue=lookup_async, effect="read")
    try:
        CALLS.clear()
        gm = distopt.optimize(UsesRemote(), passes=[])  # capture only: no split into issue + wait
        again = DistoptTracer().trace(gm)
        assert CALLS == []
        assert blocking_lookup in [n.target for n in again.nodes]
    finally:
        unregister_remote(blocking_lookup)


def test_rpc_sync_with_a_python_function_argument_generates_valid_code() -> None:
    import torch.distributed.rpc as rpc

    from distopt.remote import concrete_args, effect_of, lookup, register_read

    def server_rows(table: str, ids: torch.Tensor) -> torch.Tensor:
        return ids

    register_read(server_rows)

    class M(nn.Module):
        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return rpc.rpc_sync("ps0", server_rows, args=("emb", ids))

    model = M()
    gm = distopt.optimize(model, passes=[])  # capture only: no split into issue + wait
    assert not hasattr(model, "_distopt_fn_server_rows_0")
    call = next(n for n in gm.graph.nodes if n.target is rpc.rpc_sync)
    args, kwargs = concrete_args(call)
    assert args[1] is server_rows
    assert effect_of(lookup(rpc.rpc_sync), args, kwargs) == "read"
    assert "rpc_sync" in gm.code
