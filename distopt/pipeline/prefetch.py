"""The prefetch window: the batches in hand, each with its remote reads already issued.

Steps take batches in order. ``fill`` pulls batches from the data, moves them to the device and
runs their prefetch stage until ``max(1, staleness)`` batches are in flight; *when* the pipeline
calls it sets how stale the prefetched rows may be:

* ``staleness=0`` (exact): right after a step's pushes are issued. The servers apply a table's
  operations in issue order (:mod:`distopt.ps.client.calls`), so the next batch's rows are what a
  sequential run would read.
* ``staleness=s >= 1``: before a step's backward, for the batch ``s`` steps ahead; its rows miss at
  most the pushes of the ``s`` steps in between. These fetches are issued as
  stale reads and pushes do not wait for each other (:mod:`distopt.ps.client.ordering`): a push may
  reach the server before an earlier prefetch, making its rows fresher, never staler. With
  ``deterministic=True`` the issue order is kept instead: slower (a table's prefetch and push
  then chain), but the run repeats bitwise and the counted staleness is exact.

With ``max_staleness`` (relaxed mode only) the depth adapts in the run: when
:data:`LATE_TAKES` batches in a row are taken before all their prefetched reads arrived, the
staleness deepens by one, never past ``max_staleness``. A starting staleness chosen by the cost
model (:func:`distopt.estimate.staleness_to_hide`) is a guess of the host's speed; the run
corrects it. Deepening is never undone (a shallower window would only be late again).

Staleness is counted, not assumed: every push this trainer issues is numbered per table
(:func:`distopt.ps.client.calls.on_push`), and when a batch is taken each of its fetched rows counts the
pushes of that row issued after its fetch. Without ``deterministic`` this is an upper bound for
``staleness >= 1`` (a push issued after the fetch may still have reached the server first). Memory is measured the same way: the bytes of every
prefetched result that has arrived and waits to be used, and the bytes one batch's rows take.

The window is also the row caches' lookahead (``ps.cache``): the rows of every batch in it, and
of the batch in hand, are pinned (:func:`distopt.ps.client.calls.pin_rows`) and never evicted.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Generic, TypeVar

import torch
from torch.utils._pytree import tree_leaves

from distopt.errors import ConfigError
from distopt.pipeline.slots import Issued
from distopt.pipeline.split import PrefetchSplit
from distopt.ps.client import calls as ps_calls
from distopt.ps.client.ordering import stale_reads

B = TypeVar("B")


@dataclasses.dataclass(kw_only=True, slots=True)
class PipelineStats:
    """What the pipeline measured so far (the job logs it per step)."""

    batches: int = 0
    rows: int = 0
    """Fetched rows whose staleness was counted (parameter-server tables)."""
    staleness_sum: int = 0
    staleness_max: int = 0
    """The most updates of its own trainer that one fetched row missed."""
    inflight_bytes_max: int = 0
    """Peak bytes of prefetched results that had arrived and were not yet used."""
    batch_bytes_max: int = 0
    """Peak bytes of the prefetched results of one batch (its rows)."""
    late: int = 0
    """Batches taken before all their prefetched reads had arrived."""
    depth: int = 0
    """The staleness the pipeline prefetches with now (deepens with ``max_staleness``)."""

    @property
    def staleness_mean(self) -> float:
        return self.staleness_sum / self.rows if self.rows else 0.0


LATE_TAKES = 2
"""Batches in a row taken before their prefetched reads arrived, before the depth deepens."""

_KEY_SHIFT = 40


class PushJournal:
    """This trainer's pushes, numbered per table, kept while an in-flight fetch may have missed them.

    Ids are kept as keys ``table_index << 40 | id`` so that one ``isin`` per push depth counts a
    whole batch over every table: a step at K = 16 tables counted with an ``isin`` (and a
    ``unique`` at each push) per table spent 2–3 ms of a 100 ms step on bookkeeping. Row ids
    beyond 2**40 could only collide into an overcount, never hide a missed update.
    """

    def __init__(self) -> None:
        self.clock: dict[str, int] = collections.defaultdict(int)
        self.log: dict[str, collections.deque[tuple[int, torch.Tensor]]] = collections.defaultdict(
            collections.deque
        )
        self._index: dict[str, int] = {}

    def key(self, table: str, ids: torch.Tensor) -> torch.Tensor:
        index = self._index.setdefault(table, len(self._index))
        return ids.reshape(-1).to(torch.int64) + (index << _KEY_SHIFT)

    def record(self, table: str, ids: torch.Tensor) -> None:
        self.clock[table] += 1
        self.log[table].append(
            (self.clock[table], self.key(table, ids))
        )  # a new tensor: ids may be reused

    def missed(
        self, requests: Sequence[tuple[str, torch.Tensor]], since: dict[str, int]
    ) -> torch.Tensor:
        """Per fetched id, in request order: how many pushes of its table after number
        ``since[table]`` updated it (a push counts once however often it names the id)."""
        counts = torch.zeros(sum(ids.numel() for _, ids in requests), dtype=torch.int64)
        pending = {
            table: [ids for seq, ids in self.log.get(table, ()) if seq > since[table]]
            for table, _ in requests
        }
        if any(pending.values()):  # exact mode never has any: skip the keys
            keys = torch.cat([self.key(table, ids) for table, ids in requests])
            for depth in range(max(len(entries) for entries in pending.values())):
                pushed = [entries[depth] for entries in pending.values() if depth < len(entries)]
                counts += torch.isin(keys, torch.cat(pushed)).to(torch.int64)
        return counts

    def forget_before(self, oldest: dict[str, int]) -> None:
        """Drop pushes no fetch still in flight can have missed."""
        for table, entries in self.log.items():
            floor = oldest.get(table, self.clock[table])
            while entries and entries[0][0] <= floor:
                entries.popleft()


@dataclasses.dataclass(slots=True)
class _InFlight(Generic[B]):
    batch: B
    issued: list[Issued]
    clocks: dict[str, int]


def _ps_requests(issued: Sequence[Issued]) -> list[tuple[str, torch.Tensor]]:
    return [r for future, _, _ in issued for r in getattr(future, "requests", ())]


def _arrived(issued: Sequence[Issued]) -> bool:
    """Whether every prefetched read has its answer (reads that are no torch future count as
    arrived: their state cannot be asked without waiting)."""
    return all(future.done() for future, _, _ in issued if isinstance(future, torch.futures.Future))


def _arrived_bytes(issued: Sequence[Issued]) -> int:
    total = 0
    for future, _, _ in issued:
        if isinstance(future, torch.futures.Future) and future.done():
            try:
                value = future.value()
            except Exception:
                continue  # reported at the wait
            total += sum(
                t.untyped_storage().nbytes()
                for t in tree_leaves(value)
                if isinstance(t, torch.Tensor)
            )
    return total


def check_max_staleness(max_staleness: int | None, *, staleness: int, deterministic: bool) -> None:
    """A one-line error unless the depth can adapt from ``staleness`` up to ``max_staleness``."""
    if max_staleness is not None and (staleness < 1 or deterministic or max_staleness < staleness):
        raise ConfigError(
            f"max_staleness: {max_staleness!r} needs staleness >= 1 (got {staleness}), at most "
            "max_staleness, and deterministic off (the depth follows the host's timing)"
        )


class Prefetcher(Generic[B]):
    """Batches with their prefetch stage issued, ``max(1, staleness)`` ahead (see the module)."""

    def __init__(
        self,
        split: PrefetchSplit,
        batches: Iterator[B],
        *,
        staleness: int,
        inputs: Callable[[B], Sequence[Any]],
        to_device: Callable[[B], B] | None = None,
        deterministic: bool = False,
        max_staleness: int | None = None,
    ) -> None:
        check_max_staleness(max_staleness, staleness=staleness, deterministic=deterministic)
        self.split = split
        self.batches = batches
        self.staleness = staleness
        self.max_staleness = max_staleness
        self._late_in_a_row = 0
        self.relaxed = staleness >= 1 and not deterministic
        """Whether prefetches and pushes skip the exact issue order (see the module)."""
        self.inputs = inputs
        self.to_device = to_device
        self.stats = PipelineStats(depth=staleness)
        self.exhausted = False
        self._queue: collections.deque[_InFlight[B]] = collections.deque()
        self._journal = PushJournal()
        self._last: list[Issued] = []
        self._stop_listening = (
            ps_calls.on_push(self._journal.record) if ps_calls.is_connected() else None
        )
        self._exact_pushes: bool | None = None
        if self.relaxed and ps_calls.is_connected():
            self._exact_pushes = not ps_calls.set_stale_pushes(True)

    def fill(self) -> None:
        """Issue the prefetch stage of the next batches until ``max(1, staleness)`` are in flight."""
        self._measure()
        self._issue_ahead()

    def _issue_ahead(self) -> None:
        while len(self._queue) < max(1, self.staleness) and not self.exhausted:
            try:
                batch = next(self.batches)
            except StopIteration:
                self.exhausted = True
                break
            if self.to_device is not None:
                batch = self.to_device(batch)
            stale = stale_reads() if self.relaxed else contextlib.nullcontext()
            with torch.no_grad(), stale:
                issued = [
                    (f, tuple(a), dict(k)) for f, a, k in self.split.prefetch(*self.inputs(batch))
                ]
            clocks = {table: self._journal.clock[table] for table, _ in _ps_requests(issued)}
            self._queue.append(_InFlight(batch, issued, clocks))
        self._pin()

    def _pin(self) -> None:
        """Tell the row caches the lookahead: the rows of the batches in flight and of the batch
        in hand (its push updates the cached copies) are never evicted."""
        if ps_calls.is_connected():
            in_flight = [r for entry in self._queue for r in _ps_requests(entry.issued)]
            ps_calls.pin_rows(in_flight + _ps_requests(self._last))

    def take(self) -> tuple[B, list[Issued]]:
        """The next batch and its prefetched issues; ``StopIteration`` at the end of the data."""
        self._measure()
        if not self._queue:
            self._issue_ahead()
        if not self._queue:
            self.close()  # back to exact pushes even if the caller never closes
            raise StopIteration
        entry = self._queue.popleft()
        self._adapt(late=not _arrived(entry.issued))
        missed = self._journal.missed(_ps_requests(entry.issued), entry.clocks)
        if missed.numel():
            self.stats.rows += missed.numel()
            self.stats.staleness_sum += int(missed.sum())
            self.stats.staleness_max = max(self.stats.staleness_max, int(missed.max()))
        oldest: dict[str, int] = {}
        for other in self._queue:
            for table, clock in other.clocks.items():
                oldest[table] = min(oldest.get(table, clock), clock)
        self._journal.forget_before(oldest)
        self.stats.batches += 1
        self._last = entry.issued
        self._pin()
        return entry.batch, entry.issued

    def _adapt(self, *, late: bool) -> None:
        """Count a late batch; deepen after :data:`LATE_TAKES` in a row (up to the maximum)."""
        self.stats.late += int(late)
        self._late_in_a_row = self._late_in_a_row + 1 if late else 0
        if (
            self.max_staleness is not None
            and self.staleness < self.max_staleness
            and self._late_in_a_row >= LATE_TAKES
        ):
            self.staleness += 1
            self.stats.depth = self.staleness
            self._late_in_a_row = 0

    def before_backward(self) -> None:
        """Called by the loop before each backward: with ``staleness >= 1``, prefetch now."""
        if self.staleness >= 1:
            self.fill()

    def after_push(self) -> None:
        """Called by the loop once a step's pushes are issued: exact mode prefetches now."""
        if self.staleness == 0:
            self.fill()

    def _measure(self) -> None:
        self.stats.batch_bytes_max = max(self.stats.batch_bytes_max, _arrived_bytes(self._last))
        waiting = sum(_arrived_bytes(entry.issued) for entry in self._queue)
        self.stats.inflight_bytes_max = max(self.stats.inflight_bytes_max, waiting)

    def close(self) -> None:
        """Stop counting pushes; prefetched reads still in flight are dropped (they change nothing)."""
        if self._stop_listening is not None:
            self._stop_listening()
            self._stop_listening = None
        if self._exact_pushes:
            ps_calls.set_stale_pushes(False)
            self._exact_pushes = None
        self._queue.clear()
        self._last = []
        self._pin()
