"""The Ray transport (``distopt.ps.transport.ray``) against real server actors on a loopback Ray
instance: answers, one-line errors, deadlines, leaving, and callbacks that call again."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest
import torch
from torch.futures import Future

from distopt.errors import RemoteCallError
from distopt.ps.server.table import initial_rows
from distopt.ps.spec import ServerOptions, TableSpec
from distopt.ps.transport.ray import RayTransport
from distopt.ps.transport.ray_actor import PSServerActor

ray = pytest.importorskip("ray")

pytestmark = pytest.mark.slow

TABLE = TableSpec(name="t", num_rows=6, dim=2)
OPTIONS = ServerOptions(backend="ray", num_servers=2, seed=3)


@pytest.fixture(scope="module")
def actors(ray_cluster) -> Iterator[dict[str, object]]:
    """Two server actors, as a job has them (no placement group: not what is tested here)."""
    actor_cls = ray.remote(PSServerActor)
    handles = {
        f"ps{i}": actor_cls.options(max_concurrency=8).remote(i, (TABLE,), OPTIONS)  # type: ignore[attr-defined]
        for i in range(2)
    }
    ray.get([h.stats.remote() for h in handles.values()])
    yield handles
    for handle in handles.values():
        ray.kill(handle, no_restart=True)


@pytest.fixture
def transport(actors) -> Iterator[RayTransport]:
    transport = RayTransport(actors)
    yield transport
    transport.close()
    ray.get([h.set_latency.remote(0.0) for h in actors.values()])


def test_a_call_answers_with_tensors_from_the_named_actor(transport: RayTransport) -> None:
    rows = transport.call("ps1", "fetch", ("t", torch.tensor([1, 5])), what="fetch", timeout_s=30)
    expected = initial_rows(TABLE, OPTIONS.seed)[[1, 5]]
    assert torch.equal(rows.wait(), expected)  # rows 1 and 5 live on ps1 (row % 2)
    (spec,) = transport.call("ps0", "tables", (), what="tables", timeout_s=30).wait()
    assert spec["name"] == "t"


def test_bad_calls_fail_at_the_wait_in_one_line_naming_the_server(transport: RayTransport) -> None:
    cases = [
        ("ps0", "no_such_op", (), r"^x on ps0 failed: 'no_such_op' has no Ray actor method$"),
        (
            "ps0",
            "heartbeat",
            ("trainer0",),
            r"^x on ps0 failed: 'heartbeat' has no Ray actor method$",
        ),
        ("ps7", "stats", (), r"^x on ps7 failed: no server actor named 'ps7'$"),
        (
            "ps0",
            "fetch",
            ("u", torch.tensor([0])),
            r"^x on ps0 failed: KeyError: ps0 holds no table 'u' \(held: t\)$",
        ),
        (
            "ps0",
            "fetch",
            ("t", torch.tensor([1])),
            r"^x on ps0 failed: ConfigError: table 't': row id 1 belongs to shard 1, not shard 0$",
        ),
    ]
    for server, op, args, message in cases:
        fut = transport.call(server, op, args, what="x", timeout_s=30)  # never raises here
        with pytest.raises(RemoteCallError, match=message):
            fut.wait()


def test_no_answer_within_the_deadline_fails_like_an_rpc_timeout_and_quiesce_waits_for_ray(
    transport: RayTransport, actors
) -> None:
    ray.get(actors["ps0"].set_latency.remote(1500.0))  # every fetch sleeps that long first
    begin = time.monotonic()
    fut = transport.call("ps0", "fetch", ("t", torch.tensor([0])), what="fetch", timeout_s=0.3)
    with pytest.raises(
        RemoteCallError,
        match=r"^fetch on ps0 failed: no answer within 0\.3 s \(ps\.rpc_timeout_s\)",
    ):
        fut.wait()
    assert time.monotonic() - begin < 1.2
    # The call failed, yet Ray has not answered: quiesce says so, then waits until it has.
    assert transport.quiesce(0.0) == 1
    assert transport.quiesce(10.0) == 0
    assert time.monotonic() - begin >= 1.5


def test_leaving_fails_the_calls_still_pending(transport: RayTransport, actors) -> None:
    ray.get(actors["ps1"].set_latency.remote(1000.0))
    fut = transport.call("ps1", "fetch", ("t", torch.tensor([1])), what="fetch", timeout_s=30)
    transport.close()
    with pytest.raises(RemoteCallError, match=r"^fetch on ps1 failed: the client left the job$"):
        fut.wait()
    transport.quiesce(10.0)  # Ray still answers it; nothing is left in flight for the next test


def test_callbacks_run_on_the_transports_thread_and_may_call_again(transport: RayTransport) -> None:
    # The client's ordering starts the next call from the previous one's callback; on Ray's own
    # callback thread that would deadlock or fail.
    second: Future = Future()
    threads: list[str] = []

    def then(_: Future) -> None:
        threads.append(threading.current_thread().name)
        inner = transport.call("ps0", "stats", (), what="stats", timeout_s=30)
        inner.add_done_callback(lambda f: second.set_result(f.value()))

    transport.call("ps1", "stats", (), what="stats", timeout_s=30).add_done_callback(then)
    assert second.wait()["pid"] > 0
    assert threads == ["distopt-ps-ray-reactor"]


def test_ask_all_answers_by_server_with_exceptions_and_none_for_no_answer(
    transport: RayTransport, actors
) -> None:
    answers = transport.ask_all("incarnation", (), timeout_s=30)
    assert set(answers) == {"ps0", "ps1"} and all(not a["fenced"] for a in answers.values())
    failed = transport.ask_all("restore", ("/nonexistent/checkpoint",), timeout_s=30)
    assert all(isinstance(a, Exception) for a in failed.values())
    ray.get(actors["ps1"].set_latency.remote(1000.0))
    slow = transport.ask_all("fetch", ("t", torch.tensor([1])), timeout_s=0.3)
    assert slow["ps1"] is None and isinstance(slow["ps0"], Exception)  # row 1 is not ps0's
