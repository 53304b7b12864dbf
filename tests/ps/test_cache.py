"""The trainer's row cache against table shards in-process (no RPC): what it serves, what it
evicts, and the one-line errors of its config. ``test_cache_servers.py`` runs it on real servers."""

from __future__ import annotations

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from distopt.config import from_dict
from distopt.errors import ConfigError
from distopt.ps.client.cache import TableCache, cache_bytes, check_caches, row_bytes
from distopt.ps.server.table import ShardTable, VersionedRows
from distopt.ps.spec import CacheConfig, ServerOptions, TableSpec


class Trainer:
    """One trainer's cache over in-process shards: fetch and push as the client does."""

    def __init__(self, shards: list[ShardTable], config: CacheConfig) -> None:
        self.shards = shards
        self.cache = TableCache(shards[0].spec, config, num_shards=len(shards))
        self.served = 0
        self.missed_max = 0

    def fetch(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` (unique, ascending), each shard asked for what the cache cannot serve."""
        out = torch.empty(ids.numel(), self.cache.spec.dim)
        for shard in self.shards:
            pos = (ids % len(self.shards) == shard.shard).nonzero().squeeze(1)
            if not pos.numel():
                continue
            mine = ids[pos]
            lookup = self.cache.lookup(shard.shard, mine, torch.ones_like(mine))
            answer = shard.fetch_versioned(
                mine, lookup.held, lookup.epoch, lookup.bound, self.cache.writer
            )
            rows, served, missed = self.cache.merge(lookup, VersionedRows(*answer.fields()))
            self.served += int(served.sum())
            self.missed_max = max(self.missed_max, missed)
            out[pos] = rows
        return out

    def push(self, ids: torch.Tensor, grads: torch.Tensor, lr: float) -> None:
        for shard in self.shards:
            pos = (ids % len(self.shards) == shard.shard).nonzero().squeeze(1)
            if pos.numel():
                epoch, before, run = shard.push(ids[pos], grads[pos], lr, self.cache.writer)
                self.cache.apply_own(shard.shard, ids[pos], grads[pos], lr, epoch, before, run)


def _shards(spec: TableSpec, n: int = 2) -> list[ShardTable]:
    return [ShardTable(spec, shard=s, num_shards=n, seed=3) for s in range(n)]


def _whole(shards: list[ShardTable], ids: torch.Tensor) -> torch.Tensor:
    """What a fetch without a cache reads."""
    out = torch.empty(ids.numel(), shards[0].spec.dim)
    for shard in shards:
        pos = (ids % len(shards) == shard.shard).nonzero().squeeze(1)
        out[pos] = shard.fetch(ids[pos])
    return out


def _held(cache: TableCache) -> set[int]:
    return set(cache.held_ids().tolist())


# --- exact and bounded-stale serving -------------------------------------------------------------

steps = st.lists(
    st.tuples(
        st.lists(st.integers(0, 29), min_size=1, max_size=12),  # this trainer's batch
        st.lists(st.integers(0, 29), max_size=6),  # another trainer's push after it
    ),
    min_size=1,
    max_size=12,
)


@settings(max_examples=60, deadline=None)
@given(
    steps=steps,
    optimizer=st.sampled_from(["sgd", "adagrad", "rowwise_adagrad"]),
    policy=st.sampled_from(["lru", "lfu"]),
    capacity=st.integers(1, 30),
)
def test_exact_cache_serves_bitwise_the_servers_rows(
    steps: list[tuple[list[int], list[int]]], optimizer: str, policy: str, capacity: int
) -> None:
    spec = TableSpec(name="t", num_rows=30, dim=5, optimizer=optimizer)
    shards = _shards(spec)
    me = Trainer(shards, CacheConfig(capacity_rows=capacity, policy=policy))
    gen = torch.Generator().manual_seed(len(steps))
    for mine, other in steps:
        ids = torch.tensor(sorted(set(mine)))
        assert torch.equal(me.fetch(ids), _whole(shards, ids))
        batch = torch.tensor(mine)  # duplicates accumulate, as on the server
        me.push(batch, torch.randn(batch.numel(), 5, generator=gen), 0.1)
        if other:
            theirs = torch.tensor(other)
            for shard in shards:  # another trainer's push: the cache never hears of it
                pos = (theirs % 2 == shard.shard).nonzero().squeeze(1)
                shard.push(theirs[pos], torch.randn(pos.numel(), 5, generator=gen), 0.1)
    assert me.missed_max == 0


def test_own_updates_make_cached_rows_hits_and_others_updates_misses() -> None:
    spec = TableSpec(name="t", num_rows=10, dim=4, optimizer="rowwise_adagrad")
    shards = _shards(spec)
    me = Trainer(shards, CacheConfig(capacity_rows=10))
    ids = torch.arange(6)
    me.fetch(ids)
    assert me.served == 0
    me.push(ids, torch.ones(6, 4), 0.5)  # applied to the copies too
    assert torch.equal(me.fetch(ids), _whole(shards, ids)) and me.served == 6
    shards[1].push(torch.tensor([3]), torch.ones(1, 4), 0.5)  # another trainer updates row 3
    assert torch.equal(me.fetch(ids), _whole(shards, ids)) and me.served == 6 + 5


def _push_unanswered(
    me: Trainer, ids: torch.Tensor, grads: torch.Tensor, lr: float
) -> list[tuple[int, torch.Tensor, torch.Tensor, int, torch.Tensor]]:
    """Push as ``me`` does, but keep the answers: the push is applied on the servers and still
    in flight for the cache (what a pipeline's prefetch can look up in between)."""
    answers = []
    for shard in me.shards:
        pos = (ids % len(me.shards) == shard.shard).nonzero().squeeze(1)
        if pos.numel():
            epoch, before, run = shard.push(ids[pos], grads[pos], lr, me.cache.writer)
            answers.append((shard.shard, ids[pos], grads[pos], epoch, before, run))
    return answers


def _answer(me: Trainer, answers: list, lr: float) -> None:
    for shard, ids, grads, epoch, before, run in answers:
        me.cache.apply_own(shard, ids, grads, lr, epoch, before, run)


def _assert_copies_are_the_servers(
    me: Trainer, shards: list[ShardTable], ids: torch.Tensor
) -> None:
    """Each cached copy of ``ids`` (and its Adagrad state) is bitwise its shard's row."""
    for shard in shards:
        mine = ids[ids % 2 == shard.shard]
        slots = me.cache.slot[mine].long()
        assert torch.equal(me.cache.weight[slots], shard.fetch(mine))
        if shard.accum is not None and me.cache.state is not None:
            assert torch.equal(me.cache.state[slots], shard.accum[mine // 2])


@pytest.mark.parametrize("optimizer", ["sgd", "adagrad", "rowwise_adagrad"])
def test_own_pushes_not_yet_answered_leave_a_copy_current(optimizer: str) -> None:
    spec = TableSpec(name="t", num_rows=10, dim=4, optimizer=optimizer)
    shards = _shards(spec)
    me = Trainer(shards, CacheConfig(capacity_rows=10))
    ids = torch.arange(6)
    before = me.fetch(ids)
    gen = torch.Generator().manual_seed(0)
    first = _push_unanswered(me, ids, torch.randn(6, 4, generator=gen), 0.5)
    second = _push_unanswered(me, ids[:3], torch.randn(3, 4, generator=gen), 0.5)
    # Served from the copies, as they were before the pushes the cache has not taken yet: what
    # the servers held when the fetch was issued, ahead of these pushes.
    assert torch.equal(me.fetch(ids), before) and me.served == 6 and me.missed_max == 0
    _answer(me, first, 0.5)
    _answer(me, second, 0.5)
    # The answers bring the copies (and Adagrad's state) bitwise to the servers' rows.
    assert torch.equal(me.fetch(ids), _whole(shards, ids)) and me.served == 12
    _assert_copies_are_the_servers(me, shards, ids)


@pytest.mark.parametrize("optimizer", ["sgd", "adagrad", "rowwise_adagrad"])
def test_own_answers_out_of_order_are_applied_in_the_servers_order(optimizer: str) -> None:
    spec = TableSpec(name="t", num_rows=8, dim=3, optimizer=optimizer)
    shards = _shards(spec)
    me = Trainer(shards, CacheConfig(capacity_rows=8))
    ids = torch.arange(8)
    me.fetch(ids)
    gen = torch.Generator().manual_seed(1)
    pushes = [_push_unanswered(me, ids, torch.randn(8, 3, generator=gen), 0.3) for _ in range(3)]
    for answers in reversed(pushes):  # the last applied is answered first
        _answer(me, answers, 0.3)
    assert not me.cache.waiting
    assert torch.equal(me.fetch(ids), _whole(shards, ids)) and me.served == 8
    _assert_copies_are_the_servers(me, shards, ids)


@settings(max_examples=100, deadline=None)
@example(  # the second push's answer first: the copy must not pass for current without it
    actions=[("fetch", [0], 0), ("push", [0], 0), ("push", [0], 0), ("answer", [0], 1)]
    + [("fetch", [0], 0)],
    optimizer="adagrad",
    capacity=4,
)
@given(
    actions=st.lists(
        st.tuples(
            st.sampled_from(["fetch", "push", "answer", "other"]),
            st.lists(st.integers(0, 4), min_size=1, max_size=4),
            st.integers(0, 5),
        ),
        min_size=1,
        max_size=30,
    ),
    optimizer=st.sampled_from(["sgd", "adagrad"]),
    capacity=st.integers(1, 12),
)
def test_exact_cache_serves_the_servers_row_less_only_own_unanswered_pushes(
    actions: list[tuple[str, list[int], int]], optimizer: str, capacity: int
) -> None:
    """Fetches, own pushes whose answers come late and in any order, other writers' pushes: a
    row is served as the server holds it, or as it held it before pushes that are all this
    cache's and all unanswered; once every answer is in, every exact copy is the server's row
    at its version."""
    spec = TableSpec(name="t", num_rows=12, dim=3, optimizer=optimizer)
    shards = _shards(spec)
    me = Trainer(shards, CacheConfig(capacity_rows=capacity))
    gen = torch.Generator().manual_seed(len(actions))
    history = {row: [_whole(shards, torch.tensor([row]))] for row in range(12)}
    writers: dict[int, list[int]] = {row: [] for row in range(12)}  # per version: push number
    pending: list[tuple[int, list]] = []  # (push number, its answers), own pushes unanswered
    pushes = 0

    def record(rows: list[int], who: int) -> None:
        for row in set(rows):
            history[row].append(_whole(shards, torch.tensor([row])))
            writers[row].append(who)

    for kind, rows, pick in actions:
        ids = torch.tensor(rows)
        grads = torch.randn(len(rows), 3, generator=gen)
        if kind == "fetch":
            unique = torch.tensor(sorted(set(rows)))
            got = me.fetch(unique)
            unanswered = {number for number, _ in pending}
            for row, value in zip(unique.tolist(), got, strict=True):
                # The served version: any whose later versions are all own, unanswered pushes.
                allowed = [history[row][-1]]
                for version in range(len(writers[row]), 0, -1):
                    if writers[row][version - 1] not in unanswered:
                        break
                    allowed.append(history[row][version - 1])
                assert any(torch.equal(value, a[0]) for a in allowed), (row, kind)
        elif kind == "push":
            pushes += 1
            pending.append((pushes, _push_unanswered(me, ids, grads, 0.1)))
            record(rows, pushes)
        elif kind == "answer" and pending:
            _, answers = pending.pop(pick % len(pending))
            _answer(me, answers, 0.1)
        elif kind == "other":
            for shard in shards:
                pos = (ids % 2 == shard.shard).nonzero().squeeze(1)
                shard.push(ids[pos], grads[pos], 0.1)
            record(rows, 0)
    for _, answers in pending:
        _answer(me, answers, 0.1)
    exact = (me.cache.ids >= 0) & (me.cache.missed == 0)
    for slot in exact.nonzero().squeeze(1).tolist():
        row, version = int(me.cache.ids[slot]), int(me.cache.version[slot])
        assert torch.equal(me.cache.weight[slot], history[row][version][0])


def test_a_row_read_before_an_own_push_answered_meanwhile_is_not_held_without_it() -> None:
    spec = TableSpec(name="t", num_rows=4, dim=2)
    shards = _shards(spec, 1)
    me = Trainer(shards, CacheConfig(capacity_rows=4))
    row = torch.tensor([3])
    # A prefetch looks the row up (not held) and the server reads it; then this trainer's push
    # of the row is applied and answered (no copy to update) before the prefetch's answer.
    lookup = me.cache.lookup(0, row, torch.ones(1, dtype=torch.int64))
    answer = shards[0].fetch_versioned(row, lookup.held, lookup.epoch, lookup.bound, 0)
    _answer(me, _push_unanswered(me, row, torch.ones(1, 2), 0.1), 0.1)
    me.cache.merge(lookup, answer)
    # Held at the version it was read at, it would pass for current: the server's last push is
    # this cache's. It is not held, and the next fetch reads the pushed row.
    assert torch.equal(me.fetch(row), _whole(shards, row)) and me.served == 0
    assert torch.equal(me.fetch(row), _whole(shards, row)) and me.served == 1


@pytest.mark.parametrize("others_first", [False, True])
def test_another_writers_push_beside_an_unanswered_own_push_is_a_miss(others_first: bool) -> None:
    spec = TableSpec(name="t", num_rows=4, dim=2)
    shards = _shards(spec, 1)
    me = Trainer(shards, CacheConfig(capacity_rows=4))
    other = Trainer(shards, CacheConfig(capacity_rows=4))  # another cache: another writer
    row = torch.tensor([1])
    me.fetch(row)
    if others_first:
        other.push(row, torch.ones(1, 2), 0.1)
    pending = _push_unanswered(me, row, torch.ones(1, 2), 0.1)
    if not others_first:
        shards[0].push(row, torch.ones(1, 2), 0.1)  # a trainer without a cache
    assert torch.equal(me.fetch(row), _whole(shards, row)) and me.served == 0
    _answer(me, pending, 0.1)  # fetched after the push was applied: already newer, left alone
    assert torch.equal(me.fetch(row), _whole(shards, row)) and me.served == 1


def test_staleness_does_not_count_own_unanswered_pushes() -> None:
    spec = TableSpec(name="t", num_rows=4, dim=2)
    shards = _shards(spec, 1)
    me = Trainer(shards, CacheConfig(capacity_rows=4, consistency="staleness", staleness=1))
    row = torch.tensor([2])
    first = me.fetch(row)
    shards[0].push(row, torch.ones(1, 2), 0.1)  # another trainer's update: 1 missed
    pending = [_push_unanswered(me, row, torch.ones(1, 2), 0.1) for _ in range(3)]
    assert torch.equal(me.fetch(row), first) and me.missed_max == 1
    for answers in pending:  # the copy takes its own pushes, and counts the other one missed
        _answer(me, answers, 0.1)
    assert me.fetch(row).shape == (1, 2) and me.served == 2 and me.missed_max == 1
    shards[0].push(row, torch.ones(1, 2), 0.1)  # a second one: beyond the bound, sent again
    assert torch.equal(me.fetch(row), _whole(shards, row)) and me.served == 2


@pytest.mark.parametrize("bound", [1, 2])
def test_staleness_serves_rows_at_most_bound_updates_behind_and_counts_them(bound: int) -> None:
    spec = TableSpec(name="t", num_rows=4, dim=2)
    shards = _shards(spec, 1)
    me = Trainer(shards, CacheConfig(capacity_rows=4, consistency="staleness", staleness=bound))
    row = torch.tensor([2])
    first = me.fetch(row)
    for missed in range(1, bound + 2):
        shards[0].push(row, torch.ones(1, 2), 0.1)  # another trainer's update
        got = me.fetch(row)
        if missed <= bound:  # served from the cache, stale by ``missed``
            assert torch.equal(got, first) and me.missed_max == missed
        else:  # one too many: fetched again
            assert torch.equal(got, shards[0].fetch(row)) and me.missed_max == bound


def test_a_reloaded_shard_voids_every_cached_row() -> None:
    spec = TableSpec(name="t", num_rows=8, dim=3)
    shards = _shards(spec, 1)
    saved = shards[0].state_dict()
    me = Trainer(shards, CacheConfig(capacity_rows=8))
    ids = torch.arange(8)
    me.push(ids, torch.ones(8, 3), 1.0)
    me.fetch(ids)
    shards[0].load_state_dict(saved)  # same versions counted from 0 again: a new epoch
    assert torch.equal(me.fetch(ids), _whole(shards, ids)) and me.served == 0


# --- eviction ------------------------------------------------------------------------------------


def test_lru_evicts_the_least_recently_fetched_row() -> None:
    me = Trainer(_shards(TableSpec(name="t", num_rows=10, dim=2), 1), CacheConfig(capacity_rows=3))
    for row in (1, 2, 3, 1):
        me.fetch(torch.tensor([row]))
    me.fetch(torch.tensor([4]))
    assert _held(me.cache) == {1, 3, 4}


def test_lfu_evicts_the_least_often_fetched_row_and_admits_only_over_it() -> None:
    config = CacheConfig(capacity_rows=2, policy="lfu")
    me = Trainer(_shards(TableSpec(name="t", num_rows=10, dim=2), 1), config)
    for row in (1, 1, 1, 2, 2):
        me.fetch(torch.tensor([row]))
    me.fetch(torch.tensor([3]))  # fetched once: no slot held by a row fetched less often
    assert _held(me.cache) == {1, 2}
    me.fetch(torch.tensor([3]))
    me.fetch(torch.tensor([3]))  # now as often as row 2, which was used longer ago
    assert _held(me.cache) == {1, 3}


@settings(max_examples=80, deadline=None)
@given(
    batches=st.lists(
        st.tuples(
            st.lists(st.integers(0, 39), min_size=1, max_size=10),
            st.lists(st.integers(0, 39), max_size=10),
        ),
        min_size=1,
        max_size=15,
    ),
    capacity=st.integers(1, 12),
    policy=st.sampled_from(["lru", "lfu"]),
)
def test_pinned_rows_are_never_evicted(
    batches: list[tuple[list[int], list[int]]], capacity: int, policy: str
) -> None:
    me = Trainer(
        _shards(TableSpec(name="t", num_rows=40, dim=2)),
        CacheConfig(capacity_rows=capacity, policy=policy),
    )
    for fetched, pinned in batches:
        me.cache.pin(torch.tensor(pinned, dtype=torch.int64))
        kept = _held(me.cache) & set(pinned)
        me.fetch(torch.tensor(sorted(set(fetched))))
        held = _held(me.cache)
        assert kept <= held
        assert len(held) <= capacity


def _victims_by_sorting(cache: TableCache, count: int) -> list[int]:
    """The policy's eviction order written as two stable sorts of every unpinned held slot."""
    candidates = [
        slot
        for slot, row in enumerate(cache.ids.tolist())
        if row >= 0 and row not in set(cache.pinned.tolist())
    ]
    uses = (lambda slot: int(cache.uses[cache.ids[slot]])) if cache.uses is not None else None
    key = (lambda slot: (uses(slot), int(cache.used[slot]))) if uses else cache.used.__getitem__
    return sorted(candidates, key=lambda slot: (key(slot), slot))[:count]


@settings(max_examples=60, deadline=None)
@given(
    batches=st.lists(
        st.lists(st.integers(0, 59), min_size=1, max_size=12), min_size=1, max_size=12
    ),
    pinned=st.lists(st.integers(0, 59), max_size=8),
    count=st.integers(1, 20),
    policy=st.sampled_from(["lru", "lfu"]),
    huge_uses=st.booleans(),
)
def test_victims_are_picked_in_the_policys_order(
    batches: list[list[int]], pinned: list[int], count: int, policy: str, huge_uses: bool
) -> None:
    """The few victims a full cache needs, picked without sorting every slot, are the first of
    the policy's order; with counts too large for one 63-bit key, by sorting."""
    me = Trainer(
        _shards(TableSpec(name="t", num_rows=60, dim=2)),
        CacheConfig(capacity_rows=10, policy=policy),
    )
    for batch in batches:
        me.fetch(torch.tensor(sorted(set(batch))))
    me.cache.pin(torch.tensor(pinned, dtype=torch.int64))
    if huge_uses and me.cache.uses is not None:
        me.cache.uses.mul_(1 << 58)
    with me.cache.lock:
        got = me.cache._victims(count).tolist()
    assert got == _victims_by_sorting(me.cache, count)


# --- the config and its one-line errors ----------------------------------------------------------


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (
            {"emb0": {"capacity_rows": -5}},
            "ps.cache.emb0.capacity_rows: expected an integer >= 1, or null, got -5",
        ),
        (
            {"emb0": {"capacity_rows": 5, "capacity_bytes": 100}},
            "ps.cache.emb0.capacity_rows: expected exactly one of capacity_rows and "
            "capacity_bytes, got {'capacity_rows': 5, 'capacity_bytes': 100}",
        ),
        (
            {"emb0": {"capacity_rows": 5, "staleness": 2}},
            "ps.cache.emb0.staleness: expected 0 with consistency: exact, got 2",
        ),
        (
            {"emb0": {"capacity_rows": 5, "consistency": "staleness"}},
            "ps.cache.emb0.staleness: expected an integer >= 1 with consistency: staleness, got 0",
        ),
        (
            {"emb0": {"capacity_rows": 5, "policy": "fifo"}},
            "ps.cache.emb0.policy: expected one of 'lru', 'lfu', got 'fifo'",
        ),
    ],
)
def test_bad_cache_configs_are_one_line_errors(data: dict, message: str) -> None:
    with pytest.raises(ConfigError) as err:
        from_dict(ServerOptions, {"cache": data}, prefix="ps")
    assert str(err.value) == message


TABLES = (
    TableSpec(name="emb0", num_rows=1000, dim=16, optimizer="rowwise_adagrad"),
    TableSpec(name="emb1", num_rows=1000, dim=16),
)


def test_caches_of_tables_the_model_lacks_or_does_not_read_are_refused() -> None:
    with pytest.raises(ConfigError, match=r"^ps.cache.embx: the model has no table 'embx' \(its"):
        check_caches({"embx": CacheConfig(capacity_rows=5)}, TABLES)
    with pytest.raises(
        ConfigError,
        match=r"^ps.cache.emb1: the model does not read table 'emb1' \(its forward fetches: emb0\)$",
    ):
        check_caches({"emb1": CacheConfig(capacity_rows=5)}, TABLES, reads={"emb0"})


def test_a_capacity_beyond_memory_is_refused() -> None:
    row = row_bytes(TABLES[0])
    with pytest.raises(
        ConfigError, match=r"^ps.cache.emb0.capacity_rows: 100000 takes .* more than the 1.0 MiB"
    ):
        check_caches({"emb0": CacheConfig(capacity_rows=100_000)}, TABLES, available=1 << 20)
    with pytest.raises(ConfigError, match=r"^ps.cache.emb0.capacity_bytes: 10 bytes hold no row"):
        check_caches({"emb0": CacheConfig(capacity_bytes=10)}, TABLES)
    each = CacheConfig(capacity_rows=1000)
    assert cache_bytes(TABLES[0], each) == 1000 * row + 4 * 1000
    with pytest.raises(ConfigError, match=r"^ps.cache: the caches take .* together"):
        check_caches(
            {"emb0": each, "emb1": each},
            TABLES,
            available=cache_bytes(TABLES[0], each) + 10,
        )


def test_cache_memory_is_what_the_config_says() -> None:
    spec = TABLES[0]
    for config in (
        CacheConfig(capacity_rows=300),
        CacheConfig(capacity_bytes=20_000, policy="lfu"),
    ):
        cache = TableCache(spec, config, num_shards=2)
        assert cache.nbytes == cache_bytes(spec, config)
        if config.capacity_bytes is not None:
            assert cache.nbytes <= config.capacity_bytes
