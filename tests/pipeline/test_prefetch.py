"""The push journal's staleness count against a plain per-row count of the same pushes."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from distopt.pipeline.prefetch import PushJournal

TABLES = ("a", "b", "c")
ids_of = st.lists(st.integers(0, 20), min_size=0, max_size=12).map(
    lambda v: torch.tensor(v, dtype=torch.int64)
)
events = st.lists(
    st.one_of(
        st.tuples(st.just("push"), st.sampled_from(TABLES), ids_of),
        st.tuples(st.just("fetch"), st.sampled_from(TABLES), ids_of),
    ),
    max_size=40,
)


def _reference(
    pushes: list[tuple[str, set[int]]], table: str, ids: torch.Tensor, since: int
) -> list[int]:
    mine = [pushed for name, pushed in pushes if name == table][since:]
    return [sum(int(i) in pushed for pushed in mine) for i in ids.tolist()]


@settings(max_examples=200, deadline=None)
@given(events=events, take_at=st.integers(0, 40))
def test_each_fetched_row_counts_the_later_pushes_of_its_own_table_that_named_it(events, take_at):
    journal = PushJournal()
    pushes: list[tuple[str, set[int]]] = []
    fetches: list[tuple[str, torch.Tensor, dict[str, int]]] = []
    for kind, table, ids in events[:take_at]:
        if kind == "push":
            journal.record(table, ids)
            pushes.append((table, set(ids.tolist())))
        else:
            fetches.append((table, ids, dict(journal.clock)))
    for kind, table, ids in events[take_at:]:  # pushes after every fetch above
        if kind == "push":
            journal.record(table, ids)
            pushes.append((table, set(ids.tolist())))
    # One batch of all the fetches, each with its own clock: count them one by one and together.
    for table, ids, clocks in fetches:
        since = {table: clocks.get(table, 0)}
        assert journal.missed([(table, ids)], since).tolist() == _reference(
            pushes, table, ids, since[table]
        )


def test_a_batch_over_several_tables_is_counted_per_table_in_request_order():
    journal = PushJournal()
    journal.record("a", torch.tensor([1, 2, 2]))  # a push naming a row twice counts once
    since = dict(journal.clock) | {"b": 0}
    journal.record("a", torch.tensor([2, 3]))
    journal.record("b", torch.tensor([1]))
    journal.record("a", torch.tensor([2]))
    requests = [
        ("a", torch.tensor([[1, 2], [3, 4]])),
        ("b", torch.tensor([1, 2])),
        ("a", torch.tensor([2])),
    ]
    assert journal.missed(requests, since).tolist() == [0, 2, 1, 0, 1, 0, 2]


def test_recorded_ids_are_copied_so_a_reused_buffer_does_not_change_the_count():
    journal = PushJournal()
    buffer = torch.tensor([5, 6])
    journal.record("a", buffer)
    buffer.fill_(7)
    assert journal.missed([("a", torch.tensor([5, 6, 7]))], {"a": 0}).tolist() == [1, 1, 0]


def test_forgotten_pushes_are_no_longer_counted():
    journal = PushJournal()
    for ids in ([1], [1], [1]):
        journal.record("a", torch.tensor(ids))
    journal.forget_before({"a": 2})
    assert [seq for seq, _ in journal.log["a"]] == [3]
    assert journal.missed([("a", torch.tensor([1]))], {"a": 2}).tolist() == [1]
