"""An in-process "parameter server" for the scheduling-pass tests: real effects, real futures.

Tables live in a dict. ``fetch``/``push`` are registered remote calls (read/write, resource = the
table, batched fetches grouped by ``SERVER_OF[table]``). With ``STORE.delay_s > 0`` requests are
served by worker threads after the delay, so an issued call really runs concurrently with the
caller's local work; with 0 they complete at issue time. The store logs every applied request
with the version of the table it saw, and records *overlaps*: a request started while a
conflicting one (same table, at least one write) had not finished — which correct scheduling
never produces.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.futures import Future

from distopt.remote import register_remote

ROWS, DIM = 8, 4
SERVER_OF = {"t0": "s0", "t1": "s0", "t2": "s1"}


@dataclass
class Store:
    tables: dict[str, torch.Tensor] = field(default_factory=dict)
    versions: dict[str, int] = field(default_factory=dict)
    log: list[tuple[str, str, int]] = field(default_factory=list)
    """(``"read"``/``"write"``, table, version seen/produced) in the order requests were applied."""
    requests: int = 0
    """Requests received (a batched fetch counts once)."""
    in_flight: list[tuple[str, str]] = field(default_factory=list)
    overlaps: list[str] = field(default_factory=list)
    delay_s: float = 0.0
    fail: dict[str, str] = field(default_factory=dict)
    """Table -> message: fetches of that table raise ``ValueError(message)`` on the server."""
    lock: threading.Lock = field(default_factory=threading.Lock)

    def reset(self, *, delay_s: float = 0.0) -> None:
        with self.lock:
            self.restart_tables()
            self.log, self.in_flight, self.overlaps = [], [], []
            self.requests, self.delay_s, self.fail = 0, delay_s, {}

    def restart_tables(self) -> None:
        gen = torch.Generator().manual_seed(1)
        self.tables = {t: torch.randn(ROWS, DIM, generator=gen) for t in SERVER_OF}
        self.versions = dict.fromkeys(SERVER_OF, 0)

    def snapshot(self) -> dict[str, torch.Tensor]:
        with self.lock:
            return {t: v.clone() for t, v in self.tables.items()}


STORE = Store()
STORE.reset()
_POOL = ThreadPoolExecutor(max_workers=4, thread_name_prefix="inprocess-server")


def _serve(kinds: Sequence[tuple[str, str]], work: Callable[[], Any]) -> Future:
    """Run ``work`` as one request touching ``kinds`` ((kind, table) pairs); return its future."""
    fut: Future = Future()
    with STORE.lock:
        STORE.requests += 1
        for kind, table in kinds:
            for other_kind, other_table in STORE.in_flight:
                if table == other_table and "write" in (kind, other_kind):
                    STORE.overlaps.append(f"{kind} {table} overlaps {other_kind} {other_table}")
        STORE.in_flight.extend(kinds)

    def run() -> None:
        if STORE.delay_s:
            time.sleep(STORE.delay_s)
        try:
            result = work()
        except Exception as err:
            error: Exception | None = err
        else:
            error = None
        with STORE.lock:
            for item in kinds:
                STORE.in_flight.remove(item)
        if error is None:
            fut.set_result(result)
        else:
            fut.set_exception(error)

    if STORE.delay_s:
        _POOL.submit(run)
    else:
        run()
    return fut


def _read(table: str, ids: torch.Tensor) -> torch.Tensor:
    with STORE.lock:
        if table in STORE.fail:
            raise ValueError(STORE.fail[table])
        STORE.log.append(("read", table, STORE.versions[table]))
        return STORE.tables[table][ids.long() % ROWS].clone()


def fetch_async(table: str, ids: torch.Tensor) -> Future:
    return _serve([("read", table)], lambda: _read(table, ids))


def fetch_many_async(
    args_list: Sequence[Sequence[Any]], kwargs_list: Sequence[dict[str, Any]]
) -> Future:
    calls = [(tuple(a), dict(k)) for a, k in zip(args_list, kwargs_list, strict=True)]
    kinds = [("read", table_of(a, k)) for a, k in calls]
    return _serve(kinds, lambda: [_read(*a, **k) for a, k in calls])


def fetch(table: str, ids: torch.Tensor) -> torch.Tensor:
    """Blocking read of rows ``ids`` of ``table``."""
    return fetch_async(table, ids).wait()


def _write(table: str, ids: torch.Tensor, rows: torch.Tensor) -> None:
    with STORE.lock:
        STORE.tables[table].index_add_(0, ids.long() % ROWS, 0.5 * rows.detach().reshape(-1, DIM))
        STORE.versions[table] += 1
        STORE.log.append(("write", table, STORE.versions[table]))


def push_async(table: str, ids: torch.Tensor, rows: torch.Tensor) -> Future:
    rows = rows.detach().clone()  # what the caller passed, even if it changes later
    return _serve([("write", table)], lambda: _write(table, ids, rows))


def push(table: str, ids: torch.Tensor, rows: torch.Tensor) -> None:
    """Blocking write: ``table[ids] += 0.5 * rows``."""
    return push_async(table, ids, rows).wait()


def _restart() -> None:
    with STORE.lock:
        STORE.restart_tables()
        STORE.log.append(("write", "*", 0))


def restart_async() -> Future:
    return _serve([("write", t) for t in SERVER_OF], _restart)


def restart() -> None:
    """Blocking write of every table (no resource: conflicts with every call): fresh tables."""
    return restart_async().wait()


def table_of(args: Sequence[Any], kwargs: dict[str, Any]) -> str:
    return args[0] if args else kwargs["table"]


def server_of(args: Sequence[Any], kwargs: dict[str, Any]) -> str:
    return SERVER_OF[table_of(args, kwargs)]


register_remote(
    fetch,
    issue=fetch_async,
    effect="read",
    resource=table_of,
    batched=fetch_many_async,
    batch_key=server_of,
)
register_remote(push, issue=push_async, effect="write", resource=table_of)
register_remote(restart, issue=restart_async, effect="write")
