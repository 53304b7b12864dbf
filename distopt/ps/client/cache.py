"""A trainer's caches of parameter-server rows (``ps.cache``): one :class:`TableCache` per table.

A fetch of a cached table asks each server for the rows the cache lacks or cannot prove current:
it sends the versions it holds, the server answers every row's version and sends only the rows
that are out of date (:meth:`~distopt.ps.server.table.ShardTable.fetch_versioned`). The trainer's
own pushes still go to the servers, marked with the cache's writer token; once a push is
answered, the cache applies it to its copies with the servers' arithmetic
(:func:`~distopt.ps.server.table.step_rows`), so a copy that took exactly the updates the server
took is bitwise the server's row, and the server does not count the cache's own pushes not yet
answered against its copies. Why and how: ``docs/cache.md``.

Every method runs under the cache's lock: fetch answers and push answers arrive on transport
threads while the training loop looks rows up and pins them.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import secrets
import threading
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path

import torch

from distopt.errors import ConfigError
from distopt.ps.server.table import VersionedRows, accumulate, step_rows
from distopt.ps.spec import CacheConfig, TableSpec

ANSWER_LOG = 256
"""Own pushes whose answers found rows not held that a cache remembers (:meth:`TableCache.merge`)."""

WAITING_LIMIT = 64
"""Own pushes a cache keeps waiting for the answers of the pushes the servers applied first."""

SLOT_BYTES = 8 + 8 + 8 + 4
"""Bookkeeping per cached row: its id, version and last use (int64) and the updates it lacks
(int32)."""


def row_bytes(spec: TableSpec) -> int:
    """Bytes one cached row of ``spec`` takes: the row, its optimizer state, its bookkeeping."""
    state = {"sgd": 0, "adagrad": spec.dim, "rowwise_adagrad": 1}[spec.optimizer]
    return 4 * (spec.dim + state) + SLOT_BYTES


def table_bytes(spec: TableSpec, config: CacheConfig) -> int:
    """Bytes a cache of ``spec`` takes whatever its capacity: a slot index per table row (int32)
    and, for ``lfu``, a use count per table row (int64)."""
    return spec.num_rows * (4 + (8 if config.policy == "lfu" else 0))


def capacity_of(spec: TableSpec, config: CacheConfig) -> int:
    """Rows a cache of ``spec`` holds at most (never more than the table has)."""
    if config.capacity_rows is not None:
        return min(config.capacity_rows, spec.num_rows)
    assert config.capacity_bytes is not None  # CacheConfig holds exactly one
    room = config.capacity_bytes - table_bytes(spec, config)
    return max(0, min(room // row_bytes(spec), spec.num_rows))


def cache_bytes(spec: TableSpec, config: CacheConfig) -> int:
    """Bytes a cache of ``spec`` takes (what :attr:`TableCache.nbytes` reports)."""
    return capacity_of(spec, config) * row_bytes(spec) + table_bytes(spec, config)


def memory_available() -> int | None:
    """Bytes of memory this host can still give (``MemAvailable``); ``None`` when unknown."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, AttributeError):
        return None


def _size(nbytes: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes} bytes"


def check_caches(
    caches: Mapping[str, CacheConfig],
    tables: Sequence[TableSpec],
    *,
    reads: Collection[str] | None = None,
    available: int | None = None,
) -> None:
    """A one-line ``ConfigError`` naming ``ps.cache.<table>`` unless every cache is of one of
    ``tables``, of a table the model reads (``reads``: the tables its forward fetches, when
    known), holds a row, and all of them fit in the memory ``available`` (default: this host's).
    """
    specs = {spec.name: spec for spec in tables}
    room = memory_available() if available is None else available
    total = 0
    for name, config in caches.items():
        key = f"ps.cache.{name}"
        spec = specs.get(name)
        if spec is None:
            known = ", ".join(sorted(specs)) or "none"
            raise ConfigError(f"{key}: the model has no table {name!r} (its tables: {known})")
        if reads is not None and name not in reads:
            read = ", ".join(sorted(reads)) or "none"
            raise ConfigError(
                f"{key}: the model does not read table {name!r} (its forward fetches: {read})"
            )
        if config.capacity_rows is not None:
            asked, what = config.capacity_rows * row_bytes(spec), "capacity_rows"
            value = config.capacity_rows
        else:
            assert config.capacity_bytes is not None
            asked, what, value = config.capacity_bytes, "capacity_bytes", config.capacity_bytes
        if capacity_of(spec, config) < 1:
            raise ConfigError(
                f"{key}.capacity_bytes: {value} bytes hold no row of table {name!r} (a row takes "
                f"{row_bytes(spec)} bytes, the table's bookkeeping {table_bytes(spec, config)})"
            )
        if room is not None and asked > room:
            raise ConfigError(
                f"{key}.{what}: {value} takes {_size(asked)}, more than the {_size(room)} of "
                "memory available on this host"
            )
        total += cache_bytes(spec, config)
    if room is not None and total > room:
        raise ConfigError(
            f"ps.cache: the caches take {_size(total)} together, more than the {_size(room)} of "
            "memory available on this host"
        )


def build_caches(
    configs: Mapping[str, CacheConfig], tables: Mapping[str, tuple[TableSpec, int]]
) -> dict[str, TableCache]:
    """A cache per configured table; ``tables``: each table's spec and number of shards."""
    caches = {}
    for name, config in configs.items():
        found = tables.get(name)
        if found is None:
            held = ", ".join(sorted(tables)) or "none"
            raise ConfigError(
                f"ps.cache.{name}: the job's servers hold no table {name!r} (they hold: {held})"
            )
        spec, num_shards = found
        caches[name] = TableCache(spec, config, num_shards=num_shards)
    return caches


@dataclasses.dataclass(kw_only=True, slots=True)
class FetchCounts:
    """What this trainer's fetches took from the servers since they were last taken (a step)."""

    rows: int = 0
    """Rows the servers sent."""
    bytes: int = 0
    """Bytes of the tensors the servers sent: rows, and for caches optimizer state and versions."""
    lookups: int = 0
    """Ids fetched from cached tables, each occurrence in a batch counted."""
    hits: int = 0
    """Of those, the ids served from a cache (their row was not sent)."""
    cache_bytes: int = 0
    """Memory the caches take (:attr:`TableCache.nbytes`), when taken."""
    staleness_max: int = 0
    """Over the run so far: the most updates of other trainers that a served row had missed."""

    @property
    def hit_rate(self) -> float | None:
        """``hits / lookups``; ``None`` before any lookup."""
        return self.hits / self.lookups if self.lookups else None


@dataclasses.dataclass(slots=True, eq=False)
class _Waiting:
    """An own push answered before pushes the servers applied ahead of it, for the rows whose
    copies wait for those answers (:meth:`TableCache.apply_own`)."""

    unique: torch.Tensor
    """The push's rows (ascending) and their summed gradients: the server's shapes."""
    summed: torch.Tensor
    lr: float
    before: torch.Tensor
    """Each row's version before the push."""
    run: torch.Tensor
    """Each row's version when the cache's unbroken run of pushes to it (this one's) began."""
    pos: torch.Tensor
    """Positions in ``unique`` of the rows still waiting."""
    marks: torch.Tensor
    """What each of them added to its copy's ``missed`` while it waits."""


@dataclasses.dataclass(frozen=True, slots=True)
class Lookup:
    """What a cache holds of one server's share of a fetch, when the request left."""

    shard: int
    ids: torch.Tensor
    """The ids asked, unique and ascending."""
    held: torch.Tensor
    """The version held of each id, -1 where none is that the consistency could serve (an
    ``exact`` cache's inexact copies, a copy lacking more updates than ``staleness``)."""
    epoch: int
    """The shard's epoch the versions belong to (-1: none known)."""
    rows: torch.Tensor
    """``[len(ids), dim]``: copies of the held rows (where ``held >= 0``), as they were."""
    missed: torch.Tensor
    """Per id, the updates up to its held version that the copy lacks (0 where not held)."""
    bound: int | torch.Tensor
    """Other writers' pushes since the held version that the server may leave unsent: the
    consistency's bound, less each copy's ``missed`` where one lacks any (then per id)."""
    answered: int
    """How many of the cache's own pushes were answered when the request left."""


class TableCache:
    """Rows of one table held by this trainer: at most ``capacity`` rows in fixed slots.

    Per slot: the row, its optimizer state, its id, its version (the server's version it took
    every update up to, but ``missed`` of them: its own pushes answered since included), the
    updates up to that version it lacks (0: exact, bitwise the server's row at that version)
    and its last use. Per table row: its slot (-1: not held) and, for ``lfu``, how often it
    was fetched. Its pushes carry :attr:`writer`, so the servers tell them from others'.
    """

    def __init__(self, spec: TableSpec, config: CacheConfig, *, num_shards: int) -> None:
        self.spec = spec
        self.config = config
        self.num_shards = num_shards
        self.capacity = capacity_of(spec, config)
        self.weight = torch.zeros(self.capacity, spec.dim)
        self.state: torch.Tensor | None = None
        if spec.optimizer == "adagrad":
            self.state = torch.zeros(self.capacity, spec.dim)
        elif spec.optimizer == "rowwise_adagrad":
            self.state = torch.zeros(self.capacity)
        self.ids = torch.full((self.capacity,), -1, dtype=torch.int64)
        self.version = torch.zeros(self.capacity, dtype=torch.int64)
        self.missed = torch.zeros(self.capacity, dtype=torch.int32)
        self.used = torch.zeros(self.capacity, dtype=torch.int64)
        self.slot = torch.full((spec.num_rows,), -1, dtype=torch.int32)
        self.uses = (
            torch.zeros(spec.num_rows, dtype=torch.int64) if config.policy == "lfu" else None
        )
        self.pinned = torch.zeros(0, dtype=torch.int64)
        """Ids a batch in flight needs (:meth:`pin`): never evicted."""
        self.epochs: dict[int, int] = {}
        """Shard → the epoch the held rows of that shard belong to."""
        self.clock = 0
        self.writer = secrets.randbits(62) + 1
        """This cache's token on its pushes (never 0, which marks a push without a cache)."""
        self.answered = 0
        """Own pushes answered so far (:meth:`apply_own`)."""
        self.unheld: collections.deque[tuple[int, int, torch.Tensor, torch.Tensor]] = (
            collections.deque()
        )
        """The last :data:`ANSWER_LOG` answers that found rows not held: ``(answer number,
        shard, those rows' ids, their versions before the push)``."""
        self.forgotten = 0
        """The number of the last answer dropped from :attr:`unheld`."""
        self.waiting: collections.deque[_Waiting] = collections.deque()
        """Own pushes whose rows wait for the answers of pushes applied before them."""
        self.lock = threading.Lock()

    @property
    def nbytes(self) -> int:
        tensors = (
            self.weight,
            self.state,
            self.ids,
            self.version,
            self.missed,
            self.used,
            self.slot,
            self.uses,
        )
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)

    def __len__(self) -> int:
        """Rows held now."""
        with self.lock:
            return int((self.ids >= 0).sum())

    def held_ids(self) -> torch.Tensor:
        """The ids held now, ascending."""
        with self.lock:
            return self.ids[self.ids >= 0].sort().values

    def pin(self, ids: torch.Tensor) -> None:
        """Keep rows ``ids`` (any shape, duplicates allowed) until the next call: the rows of the
        batches in flight, which the pipeline knows ahead (its lookahead)."""
        unique = torch.unique(ids.reshape(-1).to(torch.int64))
        with self.lock:
            self.pinned = unique

    # --- fetches ----------------------------------------------------------------------------------

    def lookup(self, shard: int, ids: torch.Tensor, counts: torch.Tensor) -> Lookup:
        """What is held of ``ids`` (unique, ascending, all of ``shard``), fetched ``counts``
        times each in this request; marks the held ones used."""
        with self.lock:
            self.clock += 1
            slots = self.slot.index_select(0, ids).to(torch.int64)
            pos = (slots >= 0).nonzero().squeeze(1)
            at = slots.index_select(0, pos)
            self.used.index_fill_(0, at, self.clock)
            if self.uses is not None:
                self.uses.index_add_(0, ids, counts.to(torch.int64))
            bound = self.config.bound
            lacks = self.missed.index_select(0, at).to(torch.int64)
            usable = lacks <= bound  # exact: only exact copies; staleness: within the bound
            pos, at, lacks = pos[usable], at[usable], lacks[usable]
            held = torch.full((ids.numel(),), -1, dtype=torch.int64)
            held.index_copy_(0, pos, self.version.index_select(0, at))
            rows = torch.empty(ids.numel(), self.spec.dim)
            rows.index_copy_(0, pos, self.weight.index_select(0, at))
            missed = torch.zeros(ids.numel(), dtype=torch.int64)
            missed.index_copy_(0, pos, lacks)
            limit: int | torch.Tensor = bound - missed if bool(lacks.any()) else bound
            epoch = self.epochs.get(shard, -1)
            return Lookup(shard, ids, held, epoch, rows, missed, limit, self.answered)

    def merge(
        self, lookup: Lookup, answer: VersionedRows
    ) -> tuple[torch.Tensor, torch.Tensor, int]:
        """The rows of ``lookup.ids``: those the server sent, the rest from the cache; keeps what
        the server sent (but rows read before an own push that was answered while they
        travelled, which no copy took). Returns the rows, which ids were served from the
        cache, and the most updates of other writers one of those had missed."""
        rows = lookup.rows
        rows.index_copy_(0, answer.sent, answer.rows)
        served = torch.ones(lookup.ids.numel(), dtype=torch.bool)
        served[answer.sent] = False
        missed = answer.missed + lookup.missed[served]
        ids = lookup.ids.index_select(0, answer.sent)
        with self.lock:
            if self.epochs.get(lookup.shard) != answer.epoch:
                self._drop(self._slots_of_shard(lookup.shard))
                self.epochs[lookup.shard] = answer.epoch
            keep = ~self._lack_own(lookup, ids, answer.versions)
            state = None if answer.state is None else answer.state[keep]
            self._install(ids[keep], answer.rows[keep], state, answer.versions[keep])
        return rows, served, int(missed.max().clamp(min=0)) if missed.numel() else 0

    def _lack_own(self, lookup: Lookup, ids: torch.Tensor, versions: torch.Tensor) -> torch.Tensor:
        """Which of rows ``ids``, sent at ``versions`` for ``lookup``, lack an own push answered
        since the lookup that found them not held: held, they would look current to the server
        (its last pushes are this cache's) without that push. All, when the log has forgotten."""
        if lookup.answered < self.forgotten:
            return torch.ones(ids.numel(), dtype=torch.bool)
        lack = torch.zeros(ids.numel(), dtype=torch.bool)
        for number, shard, pushed, before in reversed(self.unheld):
            if number <= lookup.answered:
                break
            if shard != lookup.shard:
                continue
            at = torch.searchsorted(pushed, ids).clamp(max=pushed.numel() - 1)
            lack |= (pushed.index_select(0, at) == ids) & (before.index_select(0, at) >= versions)
        return lack

    def _install(
        self,
        ids: torch.Tensor,
        rows: torch.Tensor,
        state: torch.Tensor | None,
        versions: torch.Tensor,
    ) -> None:
        """Hold rows ``ids`` the server sent at ``versions``: refresh held copies the server's
        are at least as new as, and place new ones in free slots or in the slots of unpinned
        rows the policy gives up (new rows that find no slot are not held)."""
        if ids.numel() == 0:
            return
        slots = self.slot.index_select(0, ids).to(torch.int64)
        have = (slots >= 0).nonzero().squeeze(1)
        at = slots.index_select(0, have)
        newer = versions.index_select(0, have) >= self.version.index_select(0, at)
        self._write(at[newer], have[newer], rows, state, versions)
        new = (slots < 0).nonzero().squeeze(1)
        if new.numel() == 0:
            return
        if self.uses is not None:  # the most used first, to take the least used slots
            order = torch.argsort(
                self.uses.index_select(0, ids.index_select(0, new)), descending=True, stable=True
            )
            new = new.index_select(0, order)
        free = (self.ids < 0).nonzero().squeeze(1)[: new.numel()]
        targets = torch.cat([free, self._victims(new.numel() - free.numel())])
        if self.uses is not None and targets.numel() > free.numel():
            # LFU admits a new row only over a row used no more often.
            victims = targets[free.numel() :]
            candidates = ids.index_select(0, new[free.numel() : targets.numel()])
            beaten = self.uses.index_select(0, candidates) >= self.uses.index_select(
                0, self.ids.index_select(0, victims)
            )
            targets = torch.cat([free, victims[beaten.to(torch.int64).cumprod(0).bool()]])
        new = new[: targets.numel()]
        self._drop(targets[self.ids.index_select(0, targets) >= 0])
        placed = ids.index_select(0, new)
        self.ids.index_copy_(0, targets, placed)
        self.slot.index_copy_(0, placed, targets.to(torch.int32))
        self._write(targets, new, rows, state, versions)

    def _write(
        self,
        at: torch.Tensor,
        pos: torch.Tensor,
        rows: torch.Tensor,
        state: torch.Tensor | None,
        versions: torch.Tensor,
    ) -> None:
        """Slots ``at`` take ``rows[pos]`` (and their state) as the server sent them, exact at
        ``versions[pos]``."""
        self.weight.index_copy_(0, at, rows.index_select(0, pos))
        if self.state is not None and state is not None:
            self.state.index_copy_(0, at, state.index_select(0, pos))
        self.version.index_copy_(0, at, versions.index_select(0, pos))
        self.missed.index_fill_(0, at, 0)
        if self.waiting:  # the server's rows hold every push they wait with
            written = self.ids.index_select(0, at)
            for entry in self.waiting:
                entry.pos, entry.marks = _without(entry, written)
        self.used.index_fill_(0, at, self.clock)

    def _victims(self, count: int) -> torch.Tensor:
        """Up to ``count`` held, unpinned slots in the order the policy evicts them: least
        recently used first (``lru``), least used and then least recently used (``lfu``), the
        lower slot first among equals.

        Runs on every fetch answer that brings new rows into a full cache, so it picks the few
        it needs (``topk`` over one key packing the policy's order) instead of sorting every
        slot, where the key fits in 63 bits: always for ``lru`` (a slot's last use is at most
        the lookup count), for ``lfu`` while the most used row's count does."""
        if count <= 0:
            return torch.zeros(0, dtype=torch.int64)
        pinned = self.slot.index_select(0, self.pinned).to(torch.int64)
        free = self.ids >= 0
        free.index_fill_(0, pinned[pinned >= 0], False)
        candidates = free.nonzero().squeeze(1)
        count = min(count, candidates.numel())
        used = self.used.index_select(0, candidates)
        uses = (
            None
            if self.uses is None
            else self.uses.index_select(0, self.ids.index_select(0, candidates))
        )
        position_bits = candidates.numel().bit_length()
        used_bits = self.clock.bit_length()
        uses_bits = 0 if uses is None or uses.numel() == 0 else int(uses.max()).bit_length()
        if position_bits + used_bits + uses_bits <= 63:
            key = used << position_bits | torch.arange(candidates.numel())
            if uses is not None:
                key |= uses << (used_bits + position_bits)
            picked = torch.topk(key, count, largest=False, sorted=True).indices
            return candidates.index_select(0, picked)
        order = torch.argsort(used, stable=True)
        if uses is not None:  # least used first, least recently used among equals
            order = order.index_select(0, torch.argsort(uses[order], stable=True))
        return candidates.index_select(0, order[:count])

    def _slots_of_shard(self, shard: int) -> torch.Tensor:
        held = self.ids >= 0
        return (held & (self.ids % self.num_shards == shard)).nonzero().squeeze(1)

    def _drop(self, at: torch.Tensor) -> None:
        """Forget the rows in slots ``at``."""
        ids = self.ids.index_select(0, at)
        self.slot.index_fill_(0, ids[ids >= 0], -1)
        self.ids.index_fill_(0, at, -1)

    # --- the trainer's own pushes ---------------------------------------------------------------

    def apply_own(
        self,
        shard: int,
        ids: torch.Tensor,
        grads: torch.Tensor,
        lr: float,
        epoch: int,
        before: torch.Tensor,
        run: torch.Tensor,
    ) -> None:
        """Apply this trainer's push of ``grads`` to rows ``ids`` of ``shard``, which the server
        answered with its ``epoch``, each unique row's version ``before`` it and the version
        this cache's unbroken run of pushes to the row began at (``run``).

        The gradients are summed and the step taken exactly as the server did, on tensors of
        the same shapes (:func:`~distopt.ps.server.table.step_rows`), so a copy at the version
        the push was applied to becomes bitwise the server's row. A copy already newer holds
        the push (it was fetched after) or counted it missed. An older one lacks the updates
        in between: when they are all this cache's own (``run`` at or below its version),
        whose answers are still to come, the push waits for them and is then applied in the
        servers' order; else (another writer's among them) it takes the push now, moves to
        the version after it and counts them missed (served under ``staleness`` only).
        """
        unique, summed = accumulate(ids, grads.to(self.weight.dtype))
        with self.lock:
            slots = self.slot.index_select(0, unique).to(torch.int64)
            self.answered += 1
            unheld = slots < 0
            if bool(unheld.any()):  # a fetch still travelling may bring these rows without it
                if len(self.unheld) == ANSWER_LOG:
                    self.forgotten = self.unheld.popleft()[0]
                self.unheld.append((self.answered, shard, unique[unheld], before[unheld]))
            if self.epochs.get(shard) != epoch:
                self._drop(slots[slots >= 0])  # the shard was reloaded: nothing held is known
                return
            pos = (slots >= 0).nonzero().squeeze(1)
            push = _Waiting(unique, summed, lr, before, run, pos, torch.zeros(0, dtype=torch.int32))
            self._take(push)
            while self._retry():
                pass

    def _take(self, push: _Waiting) -> bool:
        """Apply ``push`` to the held copies of its rows ``push.pos`` that are at the version
        it was applied to; rows held at an older one wait (:attr:`waiting`) for the own pushes
        applied in between, counting the gap and the push itself missed meanwhile, or take it
        now, inexact, where another writer's push is in the gap. Returns whether a row took
        it."""
        slots = self.slot.index_select(0, push.unique.index_select(0, push.pos)).to(torch.int64)
        kept = slots >= 0
        pos, at = push.pos[kept], slots[kept]
        marks = push.marks[kept] if push.marks.numel() else None
        held = self.version.index_select(0, at)
        applied = push.before.index_select(0, pos)
        ready = held == applied
        if bool(ready.any()):
            self._step(push, pos[ready], at[ready])
            self.version.index_copy_(0, at[ready], applied[ready] + 1)
            if marks is not None:  # it waited: its copies lack what it counted no more
                lacks = self.missed.index_select(0, at[ready]) - marks[ready]
                self.missed.index_copy_(0, at[ready], lacks)
        ahead = held < applied
        if marks is None:
            others = ahead & (push.run.index_select(0, pos) > held)
            if bool(others.any()):
                self._step(push, pos[others], at[others])
                lacks = (applied - held)[others].to(torch.int32)
                self.missed.index_add_(0, at[others], lacks)
                self.version.index_copy_(0, at[others], applied[others] + 1)
            ahead &= ~others
        if marks is None and bool(ahead.any()):
            gap = (applied - held + 1)[ahead].to(torch.int32)
            self.missed.index_add_(0, at[ahead], gap)
            if len(self.waiting) == WAITING_LIMIT:  # its copies stay counted missed
                self.waiting.popleft()
            self.waiting.append(
                _Waiting(push.unique, push.summed, push.lr, push.before, push.run, pos[ahead], gap)
            )
        elif marks is not None:
            push.pos, push.marks = pos[ahead], marks[ahead]
        return bool(ready.any()) or marks is None and bool(others.any())

    def _retry(self) -> bool:
        """Give the waiting pushes their turn; whether one was applied."""
        progress = False
        for entry in list(self.waiting):
            progress = self._take(entry) or progress
            if entry.pos.numel() == 0:
                self.waiting.remove(entry)
        return progress

    def _step(self, push: _Waiting, pos: torch.Tensor, at: torch.Tensor) -> None:
        """Slots ``at`` take ``push`` for its rows ``pos``: the servers' step, on tensors of the
        shapes the server used (all the push's rows), so the result is bitwise the server's."""
        n = push.unique.numel()
        weight = torch.zeros(n, self.spec.dim)
        weight.index_copy_(0, pos, self.weight.index_select(0, at))
        state = None
        if self.state is not None:
            state = torch.zeros((n, *self.state.shape[1:]))
            state.index_copy_(0, pos, self.state.index_select(0, at))
        step_rows(self.spec, weight, state, torch.arange(n), push.summed, push.lr)
        self.weight.index_copy_(0, at, weight.index_select(0, pos))
        if self.state is not None and state is not None:
            self.state.index_copy_(0, at, state.index_select(0, pos))


def _without(entry: _Waiting, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``entry``'s waiting rows and marks, less rows ``ids``."""
    keep = ~torch.isin(entry.unique.index_select(0, entry.pos), ids)
    return entry.pos[keep], entry.marks[keep]
