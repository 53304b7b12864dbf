"""The client against real parameter-server processes (loopback RPC, 2 servers)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch
import torch.distributed.rpc as rpc

import distopt.ps as ps
from distopt.capture import DistoptTracer
from distopt.errors import ConfigError, RemoteCallError
from distopt.ps.client import calls, context, ordering
from distopt.ps.server.table import ShardTable, initial_rows
from distopt.ps.spec import ServerOptions, TableSpec
from distopt.ps.transport.rpc import HANDLERS
from distopt.remote import effect_of, lookup

pytestmark = pytest.mark.slow

SEED = 3
TABLES = (
    TableSpec(name="read", num_rows=10, dim=4),
    TableSpec(name="sgd", num_rows=10, dim=4),
    TableSpec(name="ada", num_rows=12, dim=3, optimizer="adagrad"),
    TableSpec(name="order", num_rows=8, dim=2),
    TableSpec(name="ckpt", num_rows=6, dim=2, optimizer="adagrad"),
    TableSpec(name="bag", num_rows=20, dim=4),
    TableSpec(name="dense", num_rows=3, dim=5, kind="dense"),
    TableSpec(name="stale", num_rows=8, dim=2),
    TableSpec(name="poisoned", num_rows=8, dim=2),
    TableSpec(name="many_sgd", num_rows=10, dim=4),
    TableSpec(name="many_ada", num_rows=12, dim=3, optimizer="adagrad"),
    TableSpec(name="many_bad", num_rows=8, dim=2),
    TableSpec(name="dry", num_rows=10, dim=4, optimizer="adagrad"),
)


@pytest.fixture(scope="module")
def job() -> Iterator[ps.PSJob]:
    options = ServerOptions(
        num_servers=2, seed=SEED, latency_ms=20, rpc_timeout_s=10, start_timeout_s=20
    )
    with ps.local_job(TABLES, options) as job:
        yield job


def _spec(name: str) -> TableSpec:
    return next(t for t in TABLES if t.name == name)


def test_fetch_returns_seeded_rows_from_both_shards_as_leaves(job: ps.PSJob) -> None:
    ids = torch.tensor([[0, 3], [7, 3]])
    rows = ps.fetch("read", ids)
    assert rows.shape == (2, 2, 4) and rows.is_leaf and rows.requires_grad
    assert torch.equal(rows.detach(), initial_rows(_spec("read"), SEED)[ids])
    assert ps.routes()["read"].servers == ("ps0", "ps1")
    ps.discard_step()


def test_dense_table_fetches_whole_tensor_from_one_server(job: ps.PSJob) -> None:
    with torch.no_grad():
        whole = ps.fetch("dense")
    assert torch.equal(whole, initial_rows(_spec("dense"), SEED)) and not whole.requires_grad
    assert len(ps.routes()["dense"].servers) == 1


@pytest.mark.parametrize("table", ["sgd", "ada"])
def test_push_applies_sparse_update_with_duplicates(job: ps.PSJob, table: str) -> None:
    spec = _spec(table)
    ids = torch.tensor([1, 2, 2, 5, 2])
    grads = torch.randn(5, spec.dim)
    expected = ShardTable(spec, shard=0, num_shards=1, seed=SEED)
    expected.push(ids, grads, lr=0.5)
    ps.push(table, ids, grads, lr=0.5)
    with torch.no_grad():
        torch.testing.assert_close(ps.fetch(table), expected.weight)


def test_async_push_then_fetch_sees_the_push(job: ps.PSJob) -> None:
    """The fetch is issued while the push is still in flight (20 ms server latency)."""
    before = initial_rows(_spec("order"), SEED)
    ids = torch.tensor([0, 1, 2, 3])
    for step in range(3):
        push = ps.push_async("order", ids, torch.ones(4, 2), lr=1.0)
        assert not push.done()
        with torch.no_grad():
            after = ps.fetch("order", ids)
        torch.testing.assert_close(after, before[ids] - (step + 1))
    ps.wait(push)


@pytest.mark.parametrize("stale", [False, True])
def test_a_stale_read_sees_earlier_pushes_and_does_not_hold_back_later_ones(
    job: ps.PSJob, stale: bool
) -> None:
    """Odd ids live on ps1, made slow (1 s); a push of even ids (ps0) issued after a slow read of
    the same table waits for it, unless the read was issued as stale."""
    with torch.no_grad():
        before = ps.fetch("stale")
    ps.push_async("stale", torch.tensor([1, 3]), torch.ones(2, 2), lr=1.0)  # in flight, 20 ms
    rpc.rpc_sync("ps1", HANDLERS["set_latency"], args=(1000.0,))
    try:
        with ordering.stale_reads() if stale else contextlib.nullcontext(), torch.no_grad():
            read = ps.fetch_async("stale", torch.tensor([1, 3]))
        push = ps.push_async("stale", torch.tensor([0, 2]), torch.ones(2, 2), lr=1.0)
        ps.wait(push)
        assert read.done() is not stale  # exact reads hold the push back; stale ones do not
        rows = read.wait()
    finally:
        rpc.rpc_sync("ps1", HANDLERS["set_latency"], args=(20.0,))
    torch.testing.assert_close(rows, before[[1, 3]] - 1)  # the push issued before it is seen
    with torch.no_grad():
        torch.testing.assert_close(
            ps.fetch("stale"), before - torch.tensor([1.0, 1, 1, 1, 0, 0, 0, 0])[:, None]
        )


@pytest.mark.parametrize("stale", [False, True])
def test_stale_pushes_overtake_earlier_pushes_and_fetches_still_see_all(
    job: ps.PSJob, stale: bool
) -> None:
    with torch.no_grad():
        before = ps.fetch("stale")
    rpc.rpc_sync("ps1", HANDLERS["set_latency"], args=(1000.0,))
    previous = calls.set_stale_pushes(stale)
    try:
        slow = ps.push_async("stale", torch.tensor([1, 3]), torch.ones(2, 2), lr=1.0)  # ps1: 1 s
        fast = ps.push_async("stale", torch.tensor([0, 2]), torch.ones(2, 2), lr=1.0)
        ps.wait(fast)
        assert slow.done() is not stale
        with torch.no_grad():
            after = ps.fetch("stale", torch.tensor([0, 1, 2, 3]))  # waits for both pushes
    finally:
        calls.set_stale_pushes(previous)
        rpc.rpc_sync("ps1", HANDLERS["set_latency"], args=(20.0,))
    torch.testing.assert_close(after, before[:4] - 1)


@pytest.mark.parametrize("stale", [False, True])
def test_a_failed_push_fails_every_later_operation_of_its_table(job: ps.PSJob, stale: bool) -> None:
    """Even after the failure is known (done), and in stale mode: the table's state is unknown."""
    previous = calls.set_stale_pushes(stale)
    try:
        bad = ps.push_async("poisoned", torch.tensor([64]), torch.ones(1, 2), lr=1.0)  # no row 64
        with pytest.raises(RemoteCallError):
            ps.wait(bad)
        with pytest.raises(RemoteCallError, match="an earlier push to the table failed"):
            ps.wait(ps.push_async("poisoned", torch.tensor([0]), torch.ones(1, 2), lr=1.0))
        with (
            torch.no_grad(),
            pytest.raises(RemoteCallError, match="an earlier push to the table failed"),
        ):
            ps.fetch("poisoned", torch.tensor([0]))
    finally:
        calls.set_stale_pushes(previous)


def test_batched_push_is_one_request_per_server_and_updates_each_table_in_order(
    job: ps.PSJob,
) -> None:
    """Three pushes (one table twice) over two servers: one request each, and the rows are what
    the same pushes made one by one give, seen by a fetch issued while the push is in flight."""
    pushes = [
        ("many_sgd", torch.tensor([0, 1, 1, 6]), torch.randn(4, 4)),
        ("many_ada", torch.tensor([[2, 3], [3, 11]]), torch.randn(2, 2, 3)),
        ("many_sgd", torch.tensor([1, 7]), torch.randn(2, 4)),
    ]
    expected = {
        name: ShardTable(_spec(name), shard=0, num_shards=1, seed=SEED)
        for name in ("many_sgd", "many_ada")
    }
    for name, ids, grads in pushes:
        expected[name].push(ids.reshape(-1), grads.reshape(ids.numel(), -1), lr=0.5)
    before = {s: ps.server_stats(s) for s in ("ps0", "ps1")}
    fut = ps.push_many_async(pushes, lr=0.5)
    assert not fut.done()  # 20 ms on each server
    with torch.no_grad():
        rows = ps.wait(ps.fetch_many_async([("many_sgd", None), ("many_ada", None)]))
    assert fut.done()
    for server in ("ps0", "ps1"):
        after = ps.server_stats(server)
        assert after["push_many"] - before[server].get("push_many", 0) == 1
        assert after.get("push", 0) == before[server].get("push", 0)
    torch.testing.assert_close(rows[0], expected["many_sgd"].weight)
    torch.testing.assert_close(rows[1], expected["many_ada"].weight)


def test_a_dry_run_push_is_a_pushs_requests_that_change_nothing(job: ps.PSJob) -> None:
    """The cost model's rehearsal: one request per server as a push (its bags' rows packed as a
    push's), a later fetch waits for it and push listeners hear of it, but rows and optimizer
    state stay; each server counts it and the CPU its handlers took."""
    state = {s: ps.server_stats(s) for s in ("ps0", "ps1")}
    before = ps.fetch("dry", torch.arange(10)).detach()
    heard: list[str] = []
    stop = calls.on_push(lambda table, ids: heard.append(table))
    try:
        fut = calls.push_many_async(
            [("dry", torch.tensor([0, 2, 1, 3]), torch.randn(2, 4).repeat_interleave(2, dim=0))],
            0.5,
            dry_run=True,
        )
        assert not fut.done()  # 20 ms on each server
        with torch.no_grad():
            rows = ps.wait(ps.fetch_async("dry", torch.arange(10)))
        assert fut.done() and ps.wait(fut) is None
    finally:
        stop()
    assert heard == ["dry"]
    assert torch.equal(rows, before)
    for shards in ps.state_dict().values():
        assert not shards["dry"]["accum"].any()  # Adagrad's state untouched on both shards
    for server in ("ps0", "ps1"):
        after = ps.server_stats(server)
        assert after["push_dry_run"] - state[server].get("push_dry_run", 0) == 1
        assert after.get("push_many", 0) == state[server].get("push_many", 0)
        assert after["cpu_us"] > state[server]["cpu_us"] and after["cpu_us_push_dry_run"] >= 0
    # A real push afterwards is applied once, as if the dry run had never been.
    expected = ShardTable(_spec("dry"), shard=0, num_shards=1, seed=SEED)
    grads = torch.randn(2, 4)
    expected.push(torch.tensor([3, 4]), grads, lr=0.5)
    ps.push("dry", torch.tensor([3, 4]), grads, lr=0.5)
    torch.testing.assert_close(ps.fetch("dry", torch.arange(10)).detach(), expected.weight)


def test_a_failed_batched_push_fails_later_operations_of_each_of_its_tables(job: ps.PSJob) -> None:
    bad = ps.push_many_async(
        [
            ("many_bad", torch.tensor([64]), torch.ones(1, 2)),  # no row 64
            ("many_sgd", torch.tensor([0]), torch.ones(1, 4)),
        ],
        lr=1.0,
    )
    with pytest.raises(RemoteCallError, match="many_bad"):
        ps.wait(bad)
    for table in ("many_bad", "many_sgd"):  # failed as one request: later operations of each fail
        with (
            torch.no_grad(),
            pytest.raises(RemoteCallError, match="an earlier push to the table failed"),
        ):
            ps.fetch(table, torch.tensor([0]))


def test_batched_push_names_the_table_whose_grads_do_not_fit(job: ps.PSJob) -> None:
    with pytest.raises(
        ConfigError,
        match=r"push to 'many_ada': grads of shape \(2, 4\) do not match 2 ids of dim 3",
    ):
        ps.push_many_async(
            [
                ("many_sgd", torch.tensor([0]), torch.ones(1, 4)),
                ("many_ada", torch.tensor([0, 1]), torch.ones(2, 4)),
            ],
            lr=1.0,
        )


def test_batched_fetch_is_one_request_per_server(job: ps.PSJob) -> None:
    before = {s: ps.server_stats(s) for s in ("ps0", "ps1")}
    ids = [torch.tensor([0, 1, 2]), torch.tensor([4, 5]), torch.tensor([9])]
    fut = ps.fetch_many_async(list(zip(("read", "read", "bag"), ids, strict=True)))
    rows = ps.wait(fut)
    assert [r.shape for r in rows] == [(3, 4), (2, 4), (1, 4)]
    assert torch.equal(rows[0].detach(), initial_rows(_spec("read"), SEED)[ids[0]])
    assert torch.equal(rows[2].detach(), initial_rows(_spec("bag"), SEED)[ids[2]])
    for server in ("ps0", "ps1"):
        after = ps.server_stats(server)
        # stats calls are not counted: the whole difference is the one batched request
        assert after["requests"] - before[server].get("requests", 0) == 1
        assert after["fetch_many"] - before[server].get("fetch_many", 0) == 1
    ps.discard_step()


def test_state_dict_round_trip(job: ps.PSJob) -> None:
    saved = ps.state_dict()
    assert set(saved) == {"ps0", "ps1"} and set(saved["ps1"]["ckpt"]) == {
        "weight",
        "accum",
        "shard",
        "num_shards",
    }
    with torch.no_grad():
        original = ps.fetch("ckpt")
    ps.push("ckpt", torch.arange(6), torch.ones(6, 2), lr=0.1)
    ps.load_state_dict(saved)
    with torch.no_grad():
        assert torch.equal(ps.fetch("ckpt"), original)


def test_server_exception_surfaces_at_the_wait(job: ps.PSJob) -> None:
    fut = ps.fetch_async("read", torch.tensor([2, 99]))  # 99 lives on ps1 and is out of range
    with pytest.raises(
        RemoteCallError, match=r"fetch of 'read' on ps1 failed: .*row id 99 outside 0\.\.9"
    ):
        ps.wait(fut)
    with pytest.raises(ConfigError, match="unknown table 'nope'"):  # caught before any RPC
        ps.fetch("nope", torch.tensor([0]))


def test_push_gradients_of_remote_embedding(job: ps.PSJob) -> None:
    spec = _spec("bag")
    emb = ps.RemoteEmbedding("bag", 4, pooling="mean")
    ids = torch.tensor([[1, 2, 2], [3, 2, 19]])
    upstream = torch.randn(2, 4)
    (emb(ids) * upstream).sum().backward()
    expected = ShardTable(spec, shard=0, num_shards=1, seed=SEED)
    expected.push(ids.reshape(-1), (upstream / 3).repeat_interleave(3, dim=0), lr=0.2)
    futures = ps.push_gradients(lr=0.2)
    assert len(futures) == 1 and not context.current()
    assert ps.push_gradients(lr=0.2) == []  # nothing fetched since
    with torch.no_grad():
        torch.testing.assert_close(ps.fetch("bag"), expected.weight)


def test_the_gradients_of_pooled_bags_travel_one_row_per_bag_and_update_as_sent_whole(
    job: ps.PSJob,
) -> None:
    """Sum-pooled bags of 4 ids over 2 servers: the ids of each shard keep their order, so each
    bag's rows on a server travel as one row and a count; the servers' rows are bitwise those
    of the rows sent one by one."""
    spec = _spec("bag")
    emb = ps.RemoteEmbedding("bag", 4, pooling="sum")
    ids = torch.tensor([[0, 2, 4, 6], [1, 3, 5, 7], [8, 8, 9, 11], [2, 2, 2, 2]])
    upstream = torch.randn(4, 4)
    with torch.no_grad():
        before = ps.fetch("bag")
    (emb(ids) * upstream).sum().backward()
    expected = ShardTable(spec, shard=0, num_shards=1, seed=SEED)
    expected.weight.copy_(before)
    expected.push(ids.reshape(-1), upstream.repeat_interleave(4, dim=0), lr=0.2)
    pushed = {s: ps.server_stats(s).get("bytes_pushed", 0) for s in ("ps0", "ps1")}
    ps.wait(ps.push_gradients(lr=0.2)[0])
    sent = {s: ps.server_stats(s)["bytes_pushed"] - pushed[s] for s in ("ps0", "ps1")}
    # ps0: bags 0, 2 (8, 8), 3: 3 rows of 4 float32 and 3 counts; ps1: bags 1, 2 (9, 11): 2 and 2
    assert sent == {"ps0": 3 * 16 + 3 * 4, "ps1": 2 * 16 + 2 * 4}
    with torch.no_grad():
        assert torch.equal(ps.fetch("bag"), expected.weight)


def test_wait_is_a_profiler_range(job: ps.PSJob) -> None:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        with torch.no_grad():
            ps.wait(ps.fetch_async("read", torch.tensor([1])))
    assert "distopt.wait:ps.fetch:read" in {e.name for e in prof.events()}


def test_a_graphs_wait_op_opens_one_range_as_the_hand_written_wait_does(job: ps.PSJob) -> None:
    """``ps.wait`` opens its own range; the graph's wait op around it opened a second one."""
    op = lookup(ps.fetch).wait_op
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        with torch.no_grad():
            op(ps.fetch_async("read", torch.tensor([1])), "model.py:1")
    waits = [e.name for e in prof.events() if e.name.startswith("distopt.wait:")]
    assert waits == ["distopt.wait:ps.fetch:read"]


def test_registration_for_the_passes(job: ps.PSJob) -> None:
    spec = lookup(ps.fetch)
    assert spec is not None and spec.issue is ps.fetch_async and spec.wait is ps.wait
    assert effect_of(spec, ("read", None), {}) == "read"
    assert spec.resource(("read", None), {}) == ("distopt.ps", "read")
    assert spec.batch_key(("read", None), {}) == ("distopt.ps", ("ps0", "ps1"))
    with torch.no_grad():
        rows = spec.wait(
            spec.batched([("read", torch.tensor([1])), ("bag", torch.tensor([2]))], [{}, {}])
        )
    assert [r.shape for r in rows] == [(1, 4), (1, 4)]
    push_spec = lookup(ps.push)
    assert push_spec is not None and effect_of(push_spec, ("read",), {}) == "write"
    raw = lookup(rpc.rpc_sync)
    assert effect_of(raw, ("ps0", HANDLERS["fetch"], ("read", torch.tensor([0]))), {}) == "read"


def test_remote_embedding_traces_to_one_fetch_node(job: ps.PSJob) -> None:
    graph = DistoptTracer().trace(ps.RemoteEmbedding("bag", 4, pooling="sum"))
    fetches = [n for n in graph.nodes if n.op == "call_function" and n.target is ps.fetch]
    assert len(fetches) == 1 and fetches[0].args[0] == "bag"
