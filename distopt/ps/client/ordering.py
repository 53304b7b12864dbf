"""Which earlier operations of a table each new fetch or push waits for (one trainer's view).

Exact by default: per table, operations take effect on the servers in the order this process
issued them. Stale (the pipeline with ``staleness >= 1``: :func:`stale_reads`,
``TableOrder.stale_pushes``) drops the rules that keep the network in the step. The rules, and
why: ``docs/ps_runtime.md`` ("Per-table order").
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Sequence

from torch.futures import Future

_LOCAL = threading.local()


@contextlib.contextmanager
def stale_reads() -> Iterator[None]:
    """Fetches issued in this thread inside the block do not hold back later pushes."""
    previous = in_stale_reads()
    _LOCAL.stale = True
    try:
        yield
    finally:
        _LOCAL.stale = previous


def in_stale_reads() -> bool:
    """Whether this thread is inside :func:`stale_reads`."""
    return bool(getattr(_LOCAL, "stale", False))


def _live(futures: dict[str, list[Future]], table: str) -> list[Future]:
    return [f for f in futures.get(table, []) if not f.done()]


class TableOrder:
    """The operations still in flight per table; callers hold their own lock around each call."""

    def __init__(self) -> None:
        self.writes: dict[str, list[Future]] = {}
        self.reads: dict[str, list[Future]] = {}
        self.stale_pushes = False
        """Whether a push may overtake the table's earlier pushes."""

    def fetch(self, tables: Sequence[str], out: Future) -> list[Future]:
        """Record fetch ``out`` of ``tables`` (``out.stale``: issued in :func:`stale_reads`);
        returns the pushes it must wait for."""
        pending = {id(w): w for t in tables for w in self._writes(t)}
        for table in tables:
            self.reads[table] = [*_live(self.reads, table), out]
        return list(pending.values())

    def push(self, tables: Sequence[str], out: Future) -> tuple[list[Future], list[Future]]:
        """Record push ``out`` of ``tables`` (one request may carry several); returns the
        (pushes, fetches) it must wait for."""
        writes: dict[int, Future] = {}
        reads: dict[int, Future] = {}
        for table in dict.fromkeys(tables):  # a table named twice must not wait on ``out`` itself
            earlier = self._writes(table)
            self.writes[table] = [*earlier, out]
            live = _live(self.reads, table)
            reads.update((id(r), r) for r in live if not getattr(r, "stale", False))
            self.reads[table] = [r for r in live if getattr(r, "stale", False)]  # still flushed
            # A stale push skips only the waiting: a failed earlier push still fails it.
            writes.update((id(w), w) for w in earlier if w.done() or not self.stale_pushes)
        return list(writes.values()), list(reads.values())

    def _writes(self, table: str) -> list[Future]:
        """The table's pushes not yet done, and its last push even when done: a failed push
        fails every later operation of its table (the table's state is unknown)."""
        writes = self.writes.get(table, [])
        return [w for w in writes[:-1] if not w.done()] + writes[-1:]

    def pending(self) -> list[Future]:
        """Every fetch and push not yet known done (what a flush waits for)."""
        return [f for futures in (*self.writes.values(), *self.reads.values()) for f in futures]
