"""One parameter server in-process (no RPC, no Ray): its operations, declared once, and what each
transport derives from them; the checkpoint files a server writes and reads."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from distopt.errors import ConfigError
from distopt.ps.server.parameter_server import OPERATIONS, ParameterServer, ServerRestarted
from distopt.ps.spec import ServerOptions, TableSpec
from distopt.ps.transport import rpc as rpc_transport
from distopt.ps.transport.ray import METHODS
from distopt.ps.transport.ray_actor import PSServerActor
from distopt.remote.registry import declared_effect

TABLES = (TableSpec(name="emb", num_rows=8, dim=3, optimizer="rowwise_adagrad"),)


@pytest.fixture
def served() -> Iterator[ParameterServer]:
    """A server the RPC handlers answer with, as in a server process."""
    server = ParameterServer(0, TABLES, ServerOptions(num_servers=1))
    rpc_transport.serve_here(server)
    yield server
    rpc_transport.serve_here(None)


def test_every_operation_is_a_handler_on_rpc_and_a_method_on_ray() -> None:
    on_rpc = {name for name, op in OPERATIONS.items() if "rpc" in op.transports}
    on_ray = {name for name, op in OPERATIONS.items() if "ray" in op.transports}
    assert set(rpc_transport.HANDLERS) == on_rpc
    assert METHODS == on_ray
    assert {
        "fetch",
        "fetch_many",
        "fetch_cached",
        "push",
        "push_many",
        "save",
        "load",
        "tables",
    } <= on_rpc & on_ray
    assert {"heartbeat", "trainer_done", "abort"} == on_rpc - on_ray  # an RPC process's trainers
    assert {"restore", "incarnation"} == on_ray - on_rpc  # only Ray restarts a server in place
    for name in on_ray:
        assert callable(getattr(PSServerActor, name)), name
    for name, handler in rpc_transport.HANDLERS.items():
        # torch pickles a handler by module and name: the server process must find this function.
        assert getattr(rpc_transport, handler.__name__) is handler
        assert handler.__name__ == f"ps_server_{name}"


def test_read_operations_are_declared_reads_and_the_rest_are_not() -> None:
    reads = {name for name, op in OPERATIONS.items() if op.read}
    assert reads == {
        "fetch",
        "fetch_many",
        "fetch_cached",
        "state_dict",
        "tables",
        "stats",
        "incarnation",
        "push_dry_run",  # a push's kernels, writing back what was there: it changes nothing
    }
    for name, handler in rpc_transport.HANDLERS.items():
        assert declared_effect(handler) == ("read" if name in reads else None), name


def test_handlers_answer_with_the_served_server(served: ParameterServer) -> None:
    rows = rpc_transport.HANDLERS["fetch"]("emb", torch.tensor([1, 5]))
    assert torch.equal(rows, served.table("emb").weight[[1, 5]])
    assert rpc_transport.HANDLERS["stats"]()["fetch"] == 1
    rpc_transport.serve_here(None)
    with pytest.raises(RuntimeError, match="not a distopt parameter server"):
        rpc_transport.HANDLERS["stats"]()


def test_rowwise_adagrad_state_survives_the_server_checkpoint(
    served: ParameterServer, tmp_path: Path
) -> None:
    rpc_transport.HANDLERS["push"]("emb", torch.tensor([1, 5, 5]), torch.randn(3, 3), 0.1)
    name, size = rpc_transport.HANDLERS["save"](str(tmp_path))
    assert name == "ps0.pt" and size > 0
    after = ParameterServer(0, TABLES, ServerOptions(num_servers=1))
    assert not torch.equal(after.table("emb").accum, served.table("emb").accum)
    after.load(str(tmp_path))
    assert torch.equal(after.table("emb").weight, served.table("emb").weight)
    assert torch.equal(after.table("emb").accum, served.table("emb").accum)
    assert after.table("emb").accum.shape == (8,)


def test_a_batched_push_with_a_bad_row_or_gradient_changes_no_table(
    served: ParameterServer,
) -> None:
    push_many = rpc_transport.HANDLERS["push_many"]
    before = served.table("emb").weight.clone()
    with pytest.raises(ConfigError, match=r"row id 8 outside 0\.\.7"):
        push_many(
            [
                ("emb", torch.tensor([1]), torch.ones(1, 3)),
                ("emb", torch.tensor([8]), torch.ones(1, 3)),
            ],
            0.5,
        )
    with pytest.raises(ConfigError, match=r"grads of shape \(2, 3\) for 1 ids of dim 3"):
        push_many(
            [
                ("emb", torch.tensor([1]), torch.ones(1, 3)),
                ("emb", torch.tensor([2]), torch.ones(2, 3)),
            ],
            0.5,
        )
    assert torch.equal(served.table("emb").weight, before)
    push_many(
        [
            ("emb", torch.tensor([1]), torch.ones(1, 3)),
            ("emb", torch.tensor([1, 2]), torch.ones(2, 3)),
        ],
        0.5,
    )
    assert not torch.equal(served.table("emb").weight[1:3], before[1:3])
    assert torch.equal(served.table("emb").weight[3:], before[3:])


def test_a_fenced_server_refuses_row_calls_until_every_shard_is_replaced(tmp_path: Path) -> None:
    server = ParameterServer(0, TABLES, ServerOptions(num_servers=1))
    server.answer(OPERATIONS["push"], ("emb", torch.tensor([2]), torch.ones(1, 3), 0.5))
    server.answer(OPERATIONS["save"], (str(tmp_path),))
    saved = server.table("emb").weight.clone()
    server.answer(OPERATIONS["push"], ("emb", torch.tensor([2]), torch.ones(1, 3), 0.5))
    server.fence = "ps0 was restarted by Ray"
    for name, args in [
        ("fetch", ("emb", torch.tensor([0]))),
        ("push", ("emb", torch.tensor([0]), torch.ones(1, 3), 0.1)),
        ("save", (str(tmp_path),)),
    ]:
        with pytest.raises(
            ServerRestarted, match=r"^ps0 was restarted by Ray; call distopt\.ps\.recover\(\)"
        ):
            server.answer(OPERATIONS[name], args)
    assert server.answer(OPERATIONS["incarnation"], ())["fenced"]
    assert server.answer(OPERATIONS["stats"], ())["push"] == 2  # what the server is still answers
    assert server.answer(OPERATIONS["restore"], (str(tmp_path),)) == str(tmp_path)
    assert torch.equal(server.table("emb").weight, saved) and not server.fence
    assert server.answer(OPERATIONS["stats"], ())["push"] == 2  # counts survive a restore


def test_a_failed_restore_leaves_the_shards_and_the_fence_as_they_were(tmp_path: Path) -> None:
    server = ParameterServer(0, TABLES, ServerOptions(num_servers=1))
    server.push("emb", torch.tensor([4]), torch.ones(1, 3), 0.5)
    before = server.table("emb").weight.clone()
    server.fence = "restarted"
    with pytest.raises(ConfigError, match=r"ps0: cannot load checkpoint .*ps0\.pt"):
        server.answer(OPERATIONS["restore"], (str(tmp_path / "missing"),))
    assert torch.equal(server.table("emb").weight, before) and server.fence == "restarted"


def test_trainers_that_said_nothing_for_the_timeout_are_silent() -> None:
    server = ParameterServer(0, TABLES, ServerOptions(num_servers=1))
    server.expect_trainers(2)
    server.start_listening()
    assert server.silent_trainers(timeout_s=60.0) == []
    server.heartbeat("trainer0")
    server.trainer_done("trainer1")
    assert not server.stop.is_set()
    assert [name for name, _ in server.silent_trainers(timeout_s=0.0)] == ["trainer0"]
    server.trainer_done("trainer0")
    assert server.stop.is_set() and server.silent_trainers(timeout_s=0.0) == []
