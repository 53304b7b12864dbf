"""The client's future plumbing (``distopt.ps.client.futures``): starting a request after those it
is ordered after, joining answers, and the rows a fetch returns as leaves."""

from __future__ import annotations

import threading

import pytest
import torch
from torch.futures import Future

from distopt.errors import RemoteCallError
from distopt.ps.client import context
from distopt.ps.client.futures import FetchFuture, after, first_error, gather, when_all


def _resolved(value: object = None, error: Exception | None = None) -> Future:
    fut: Future = Future()
    if error is None:
        fut.set_result(value)
    else:
        fut.set_exception(error)
    return fut


def test_when_all_calls_back_once_after_the_last_future() -> None:
    a, b = Future(), Future()
    calls: list[str] = []
    when_all([a, b, _resolved()], lambda: calls.append("done"))
    a.set_result(1)
    assert calls == []
    b.set_exception(RuntimeError("failed too"))  # failures count as done
    assert calls == ["done"]


def test_when_all_of_done_futures_calls_back_at_once() -> None:
    calls: list[str] = []
    when_all([_resolved(), _resolved()], lambda: calls.append("done"))
    when_all([], lambda: calls.append("none"))
    assert calls == ["done", "none"]


def test_when_all_counts_each_future_once_across_threads() -> None:
    futures = [Future() for _ in range(64)]
    calls: list[int] = []
    when_all(futures, lambda: calls.append(1))
    threads = [threading.Thread(target=f.set_result, args=(i,)) for i, f in enumerate(futures)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert calls == [1]


def test_first_error_is_the_first_failed_future_in_order() -> None:
    first, second = RuntimeError("one"), RuntimeError("two")
    assert first_error([_resolved(), _resolved(error=first), _resolved(error=second)]) is first
    assert first_error([_resolved(), _resolved()]) is None


def test_after_starts_once_writes_and_reads_are_done_and_finishes_with_the_answer() -> None:
    write, read = Future(), Future()
    out: Future = Future()
    started: list[str] = []
    answer: Future = Future()

    def start() -> Future:
        started.append("start")
        return answer

    after(out, writes=[write], reads=[read], start=start, finish=lambda v: v * 2, what="ps.fetch:t")
    write.set_result(None)
    assert started == []
    read.set_exception(RuntimeError("a failed read does not matter to later calls"))
    assert started == ["start"] and not out.done()
    answer.set_result(21)
    assert out.wait() == 42


@pytest.mark.parametrize("signal_error", [KeyboardInterrupt(), SystemExit(143)])
def test_an_interrupted_start_fails_the_call_and_still_ends_the_program(signal_error) -> None:
    """Ctrl-C (or SIGTERM, which a bench over a link turns into SystemExit) while a request is
    sent: the call fails, so the flush on the way out does not wait for it forever, and the
    signal goes on."""
    out: Future = Future()

    def start() -> Future:
        raise signal_error

    with pytest.raises(type(signal_error)):
        after(out, writes=[], reads=[], start=start, finish=lambda v: v, what="ps.fetch:t")
    assert out.done()
    with pytest.raises(RemoteCallError, match="ps.fetch:t"):
        out.wait()


def test_an_interrupted_finish_still_fails_the_call() -> None:
    """The answer came before the callback was added, so ``finish`` runs on this thread, inside
    PyTorch's callback (which drops what a callback raises): Ctrl-C landing in it (unpickling,
    a cache update) still fails the call, so nothing waits for it forever."""
    out: Future = Future()

    def finish(_value: object) -> None:
        raise KeyboardInterrupt

    after(out, writes=[], reads=[], start=lambda: _resolved(1), finish=finish, what="ps.push:t")
    with pytest.raises(RemoteCallError, match="ps.push:t: KeyboardInterrupt"):
        out.wait()


def test_a_failed_earlier_write_fails_the_call_without_starting_it() -> None:
    out: Future = Future()
    started: list[str] = []
    after(
        out,
        writes=[_resolved(error=RemoteCallError("push to 't' on ps0 failed: lost"))],
        reads=[],
        start=lambda: started.append("start") or _resolved(),
        finish=lambda v: v,
        what="ps.fetch:t",
    )
    assert started == []
    with pytest.raises(
        RemoteCallError, match=r"^ps\.fetch:t: an earlier push to the table failed: push"
    ):
        out.wait()


def test_errors_of_start_and_finish_become_remote_call_errors_naming_the_call() -> None:
    def boom() -> Future:
        raise ValueError("bad ids")

    out: Future = Future()
    after(out, writes=[], reads=[], start=boom, finish=lambda v: v, what="ps.fetch:t")
    with pytest.raises(RemoteCallError, match=r"^ps\.fetch:t: bad ids$"):
        out.wait()
    out = Future()
    after(
        out,
        writes=[],
        reads=[],
        start=lambda: _resolved(1),
        finish=lambda v: 1 / 0,
        what="ps.push:t",
    )
    with pytest.raises(RemoteCallError, match=r"^ps\.push:t: division by zero$"):
        out.wait()
    # A RemoteCallError passes as it is: it names its server already.
    out = Future()
    named = RemoteCallError("fetch of 't' on ps1 failed: KeyError: 't'")
    after(
        out, writes=[], reads=[], start=lambda: _resolved(error=named), finish=lambda v: v, what="x"
    )
    with pytest.raises(RemoteCallError, match=r"^fetch of 't' on ps1 failed: KeyError: 't'$"):
        out.wait()


def test_gather_keeps_the_order_of_its_parts_and_fails_with_the_first_error() -> None:
    a, b = Future(), Future()
    joined = gather([a, b])
    b.set_result("b")
    assert not joined.done()
    a.set_result("a")
    assert joined.wait() == ["a", "b"]
    failing = gather([_resolved("ok"), _resolved(error=RuntimeError("ps1 gone"))])
    with pytest.raises(RuntimeError, match="ps1 gone"):
        failing.wait()


def test_fetched_rows_become_leaves_once_and_are_recorded_for_the_push() -> None:
    context.discard_step()
    ids = torch.tensor([[1, 2]])
    fut = FetchFuture((("t", ids),), single=True, label="ps.fetch:t")
    rows = torch.ones(1, 2, 3)
    leaf = fut.leaves(rows)
    assert leaf.requires_grad and leaf.is_leaf and fut.leaves(rows) is leaf
    (record,) = context.take()
    assert record.table == "t" and torch.equal(record.ids, ids.reshape(-1)) and record.rows is leaf


def test_rows_fetched_without_grad_are_not_recorded() -> None:
    context.discard_step()
    fut = FetchFuture((("t", torch.tensor([0])), ("u", torch.tensor([1]))), single=False, label="x")
    with torch.no_grad():
        t_rows, u_rows = fut.leaves([torch.ones(1, 2), torch.zeros(1, 2)])
    assert not t_rows.requires_grad and not u_rows.requires_grad
    assert context.take() == []
