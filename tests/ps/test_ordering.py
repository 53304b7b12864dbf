"""What each new fetch or push of a table waits for (``distopt.ps.client.ordering``), exact and stale."""

from __future__ import annotations

from torch.futures import Future

from distopt.ps.client.ordering import TableOrder, in_stale_reads, stale_reads


def _fetch(order: TableOrder, *tables: str, stale: bool = False) -> tuple[Future, list[Future]]:
    out: Future = Future()
    out.stale = stale  # type: ignore[attr-defined]  # as FetchFuture sets it
    return out, order.fetch(list(tables), out)


def _push(order: TableOrder, *tables: str) -> tuple[Future, tuple[list[Future], list[Future]]]:
    out: Future = Future()
    return out, order.push(list(tables), out)


def _done(fut: Future, error: Exception | None = None) -> Future:
    if error is None:
        fut.set_result(None)
    else:
        fut.set_exception(error)
    return fut


def test_a_fetch_waits_for_the_pending_pushes_of_its_tables_only() -> None:
    order = TableOrder()
    push_a, _ = _push(order, "a")
    push_b, _ = _push(order, "b")
    _, writes = _fetch(order, "a")
    assert writes == [push_a]
    _, writes = _fetch(order, "a", "b")
    assert set(map(id, writes)) == {id(push_a), id(push_b)}
    _, writes = _fetch(order, "c")
    assert writes == []


def test_fetches_of_a_table_run_beside_each_other() -> None:
    order = TableOrder()
    _fetch(order, "a")
    _, writes = _fetch(order, "a")
    assert writes == []


def test_a_push_waits_for_the_earlier_push_and_every_fetch_before_it() -> None:
    order = TableOrder()
    first, _ = _push(order, "a")
    fetch_a, _ = _fetch(order, "a")
    fetch_b, _ = _fetch(order, "b")
    _, (writes, reads) = _push(order, "a")
    assert writes == [first] and reads == [fetch_a]  # not the fetch of another table
    # A fetch after that push waits for it, not for the one before (which it waited for already).
    _done(first)
    _, writes = _fetch(order, "a")
    assert len(writes) == 1 and writes[0] is not first


def test_a_table_named_twice_in_one_push_does_not_wait_for_itself() -> None:
    order = TableOrder()
    out, (writes, reads) = _push(order, "a", "a")
    assert out not in writes and writes == [] and reads == []


def test_the_last_push_is_kept_when_done_so_its_failure_reaches_later_calls() -> None:
    order = TableOrder()
    failed, _ = _push(order, "a")
    _done(failed, RuntimeError("lost"))
    _, writes = _fetch(order, "a")
    assert writes == [failed]  # done, yet still a dependency: the table's state is unknown
    ok, _ = _push(order, "a")
    _done(ok)
    _, writes = _fetch(order, "a")
    assert writes == [ok]  # a later push that succeeded replaces it


def test_stale_reads_do_not_hold_back_later_pushes_but_are_still_flushed() -> None:
    order = TableOrder()
    assert not in_stale_reads()
    with stale_reads():
        assert in_stale_reads()
        with stale_reads():
            pass
        assert in_stale_reads()  # nested blocks restore what was before them
        prefetch, _ = _fetch(order, "a", stale=in_stale_reads())
    assert not in_stale_reads()
    exact, _ = _fetch(order, "a")
    _, (writes, reads) = _push(order, "a")
    assert reads == [exact] and writes == []
    assert prefetch in order.pending()


def test_stale_pushes_skip_waiting_for_earlier_pushes_but_not_their_failure() -> None:
    order = TableOrder()
    order.stale_pushes = True
    first, _ = _push(order, "a")
    second, (writes, _) = _push(order, "a")
    assert writes == []  # may overtake the pending push: summed updates
    _, fetch_writes = _fetch(order, "a")
    assert set(map(id, fetch_writes)) == {id(first), id(second)}  # a fetch still waits for both
    _done(first)
    _done(second, RuntimeError("lost"))
    _, (writes, _) = _push(order, "a")
    assert writes == [second]  # the failed last push still fails the next one


def test_pending_lists_every_fetch_and_push_not_yet_known_done() -> None:
    order = TableOrder()
    push, _ = _push(order, "a")
    fetch, _ = _fetch(order, "b")
    assert set(map(id, order.pending())) == {id(push), id(fetch)}
