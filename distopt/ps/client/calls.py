"""Trainer-side calls to the parameter servers, as users write them in model code.

Blocking calls (what distopt's passes rewrite) and their asynchronous counterparts (what the
passes emit, or a hand-optimized model calls)::

    rows = distopt.ps.fetch(self.table, ids)        # [*ids.shape, dim]; a leaf with requires_grad
    fut = distopt.ps.fetch_many_async([(t1, ids1), (t2, ids2)])   # ONE request per server
    rows1, rows2 = distopt.ps.wait(fut)              # inside record_function("distopt.wait:...")

Every call goes through the :class:`Client` of the job this process joined (:func:`current`),
over the job's transport. Ordering, errors, devices and wait time: ``docs/ps_runtime.md``
("The client").
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch.autograd.profiler import record_function
from torch.futures import Future

from distopt.errors import ConfigError, RemoteCallError
from distopt.ps.client import context
from distopt.ps.client.cache import FetchCounts, Lookup, TableCache
from distopt.ps.client.futures import FetchFuture, after, gather, when_all
from distopt.ps.client.ordering import TableOrder, in_stale_reads
from distopt.ps.server.table import VersionedRows, pack_rows
from distopt.ps.spec import TableSpec
from distopt.ps.transport.base import Transport

Ids = torch.Tensor | Sequence[int] | None


@dataclass(frozen=True)
class Route:
    """Where a table lives: ``servers[s]`` holds the rows with ``id % len(servers) == s``."""

    spec: TableSpec
    servers: tuple[str, ...]


class Client:
    """One trainer's view of its job's servers: where each table lives, how requests travel,
    what each new request must wait for, and where fetched rows land."""

    def __init__(
        self,
        routes: Mapping[str, Route],
        *,
        transport: Transport,
        rpc_timeout_s: float,
        servers: Sequence[str] = (),
        caches: Mapping[str, TableCache] | None = None,
    ) -> None:
        self.routes = dict(routes)
        self.transport = transport
        self.call = transport.call
        """How every request reaches a server; the ordering below is the same for any transport."""
        self.timeout_s = rpc_timeout_s
        self.servers = tuple(
            sorted(
                {*servers, *(s for r in self.routes.values() for s in r.servers)}, key=_server_order
            )
        )
        """Every server of the job: those holding tables, and those that hold none (a model may
        keep its remote state in its own functions)."""
        self.lock = threading.Lock()
        self.order = TableOrder()
        """What each new fetch or push waits for; guarded by ``lock``."""
        self.device = torch.device("cpu")
        self.copy_stream: Any = None
        """CUDA stream of host-to-device row copies (made on the first fetch to a GPU)."""
        self.push_listeners: list[Callable[[str, torch.Tensor], None]] = []
        self.waited_s = 0.0
        """Seconds spent in :func:`wait` since :func:`take_wait_time` last asked."""
        self.caches: dict[str, TableCache] = dict(caches or {})
        """Row caches by table (``ps.cache``; :mod:`distopt.ps.client.cache`)."""
        self.fetched = FetchCounts()
        """What fetches took since :func:`take_fetch_counts` last asked; guarded by ``counts_lock``."""
        self.counts_lock = threading.Lock()

    def route(self, table: str) -> Route:
        route = self.routes.get(table)
        if route is None:
            known = ", ".join(sorted(self.routes)) or "none"
            raise ConfigError(f"parameter server: unknown table {table!r} (known: {known})")
        return route

    def flush(self) -> None:
        """Wait for every fetch and push issued so far (before a checkpoint or shutdown)."""
        with self.lock:
            pending = self.order.pending()
        done = threading.Event()
        when_all(pending, done.set)
        done.wait()
        for fut in pending:
            try:
                fut.wait()
            except RemoteCallError:
                pass  # reported to whoever waits on it; flush only orders

    def count_fetched(self, counts: FetchCounts) -> None:
        """Add what one fetch took to :attr:`fetched`."""
        with self.counts_lock:
            total = self.fetched
            total.rows += counts.rows
            total.bytes += counts.bytes
            total.lookups += counts.lookups
            total.hits += counts.hits
            total.staleness_max = max(total.staleness_max, counts.staleness_max)

    def forget_order(self) -> None:
        """Start every table's order afresh: a failed push no longer fails its table's later
        calls (after every server was reloaded from one checkpoint: :func:`distopt.ps.recover`)."""
        with self.lock:
            stale = self.order.stale_pushes
            self.order = TableOrder()
            self.order.stale_pushes = stale


def _server_order(name: str) -> tuple[int, str]:
    digits = name[2:] if name.startswith("ps") else ""
    return (int(digits), name) if digits.isdigit() else (1 << 30, name)


_CURRENT: Client | None = None


def connect(client: Client | None) -> None:
    """Make ``client`` the one this process's calls use (``None``: leave; the session does both)."""
    global _CURRENT
    _CURRENT = client


def current() -> Client:
    """The client of the job this process joined as a trainer.

    Process-wide because model code calls ``distopt.ps.fetch(table, ids)`` as users write it, with
    no handle to pass, and the graph passes rewrite those calls in place (as ``torch.distributed``
    keeps its default group). :class:`distopt.ps.cluster.session.Session` sets it on joining a job
    and clears it on leaving.
    """
    if _CURRENT is None:
        raise RemoteCallError(
            "parameter server client not initialized: call distopt.ps.init_trainer(...) first"
        )
    return _CURRENT


def is_connected() -> bool:
    """Whether this process is a parameter-server trainer (it joined a job)."""
    return _CURRENT is not None


def set_device(device: torch.device | str) -> None:
    """Fetched rows land on ``device`` from now on (the trainer's device; default CPU)."""
    client = current()
    client.device = torch.device(device)
    if client.device.type == "cuda" and client.copy_stream is None:
        client.copy_stream = torch.cuda.Stream(client.device)


def set_stale_pushes(on: bool) -> bool:
    """Let pushes overtake the table's earlier pushes (``on``) or keep issue order; returns the
    previous setting. The pipeline turns it on for ``staleness >= 1`` (see the module)."""
    client = current()
    with client.lock:
        previous, client.order.stale_pushes = client.order.stale_pushes, bool(on)
    return previous


def take_wait_time() -> float:
    """Seconds spent blocked in :func:`wait` since the previous call (then reset to 0); 0 when
    this process is no trainer."""
    client = _CURRENT
    if client is None:
        return 0.0
    waited, client.waited_s = client.waited_s, 0.0
    return waited


def take_fetch_counts() -> FetchCounts:
    """What this trainer's fetches took from the servers since the previous call (rows, bytes,
    cache lookups and hits; then reset), with the caches' memory and the most staleness a
    cached row was served with so far; all zero when this process is no trainer."""
    client = _CURRENT
    if client is None:
        return FetchCounts()
    with client.counts_lock:
        taken, client.fetched = (
            client.fetched,
            FetchCounts(staleness_max=client.fetched.staleness_max),
        )
    taken.cache_bytes = sum(cache.nbytes for cache in client.caches.values())
    return taken


def pin_rows(requests: Sequence[tuple[str, torch.Tensor]]) -> None:
    """Rows ``(table, ids)`` the batches in flight need: no cache evicts them until the next
    call (the pipeline's lookahead; :class:`distopt.pipeline.Prefetcher` calls it)."""
    client = _CURRENT
    if client is None or not client.caches:
        return
    by_table: dict[str, list[torch.Tensor]] = {}
    for table, ids in requests:
        if table in client.caches:
            by_table.setdefault(table, []).append(torch.as_tensor(ids).reshape(-1).to("cpu"))
    for table, cache in client.caches.items():
        pinned = by_table.get(table)
        cache.pin(torch.cat(pinned) if pinned else torch.zeros(0, dtype=torch.int64))


@contextmanager
def using_caches(caches: Mapping[str, TableCache]) -> Iterator[None]:
    """Fetches and pushes use ``caches`` (empty: none) instead of the job's ``ps.cache`` until
    the block ends: a benchmark compares models with and without a cache on one job's servers.
    Everything issued in the block is waited for before it ends, so a push's answer updates the
    caches it was issued with."""
    client = current()
    previous, client.caches = client.caches, dict(caches)
    try:
        yield
    finally:
        client.flush()
        client.caches = previous


def on_push(listener: Callable[[str, torch.Tensor], None]) -> Callable[[], None]:
    """Call ``listener(table, flat_ids)`` for every push this process issues from now on (the
    pipeline counts how stale its prefetched rows are); returns the function that stops it."""
    listeners = current().push_listeners
    listeners.append(listener)
    return lambda: listeners.remove(listener) if listener in listeners else None


def routes() -> dict[str, Route]:
    """The tables this trainer can reach, by name."""
    return dict(current().routes)


def wait(fut: Future) -> Any:
    """Block until ``fut`` is done, inside ``record_function("distopt.wait:<label>")``.

    For a fetch: the rows (a list for a batched fetch) as leaves with ``requires_grad`` when grad
    mode is on, recorded for :func:`push_gradients`. For a push: ``None``. Errors raised on a server
    are re-raised here as :class:`RemoteCallError`.
    """
    label = getattr(fut, "label", "remote")
    begin = time.perf_counter()
    with record_function(f"distopt.wait:{label}"):
        try:
            value = fut.wait()
        finally:
            client = _CURRENT
            if client is not None:
                client.waited_s += time.perf_counter() - begin
    if isinstance(fut, FetchFuture):
        return fut.leaves(value)
    return value


def flush() -> None:
    """Wait for every fetch and push this process issued (before a checkpoint or shutdown)."""
    current().flush()


# --- fetch -------------------------------------------------------------------------------------


def _as_ids(route: Route, ids: Ids) -> torch.Tensor:
    if ids is None:
        return torch.arange(route.spec.num_rows)
    if not isinstance(ids, torch.Tensor):
        ids = torch.as_tensor(ids)
    if ids.dtype not in (torch.int64, torch.int32, torch.int16, torch.uint8):
        raise ConfigError(f"table {route.spec.name!r}: ids must be integers, got dtype {ids.dtype}")
    return ids.to("cpu", torch.int64)  # requests are sent from host memory


def _split(ids: torch.Tensor, n: int) -> list[tuple[int, torch.Tensor | None, torch.Tensor]]:
    """``[(shard, positions_in_flat_ids or None for all, shard_ids)]`` for non-empty shards."""
    flat = ids.reshape(-1)
    if n == 1:
        return [(0, None, flat)] if flat.numel() else []
    owner = flat % n
    parts: list[tuple[int, torch.Tensor | None, torch.Tensor]] = []
    for shard in range(n):
        pos = (owner == shard).nonzero().squeeze(1)
        if pos.numel():
            parts.append((shard, pos, flat.index_select(0, pos)))
    return parts


def fetch_many_async(requests: Sequence[tuple[str, Ids]]) -> FetchFuture:
    """Fetch several ``(table, ids)`` at once: one RPC per server, results in request order."""
    return _fetch(requests, single=False)


def fetch_async(table: str, ids: Ids = None) -> FetchFuture:
    """Issue a fetch of rows ``ids`` (all rows when ``None``) of ``table``; resolve with :func:`wait`."""
    return _fetch(((table, ids),), single=True)


def fetch(table: str, ids: Ids = None) -> torch.Tensor:
    """Rows ``ids`` of ``table`` as a ``[*ids.shape, dim]`` leaf tensor (blocking)."""
    return wait(fetch_async(table, ids))


@dataclass
class _Piece:
    """One server's share of one fetched ``(table, ids)``."""

    index: int
    """The request it belongs to."""
    pos: torch.Tensor | None
    """Its positions in the request's flat ids (``None``: all of them)."""
    table: str
    ids: torch.Tensor
    shard: int
    cache: TableCache | None
    lookup: Lookup | None = None
    """What the cache held of ``ids`` (unique) when the request left."""
    inverse: torch.Tensor | None = None
    """``ids`` as positions in ``lookup.ids``."""

    def cache_request(
        self,
    ) -> tuple[str, torch.Tensor, torch.Tensor | None, int, int | torch.Tensor, int]:
        """The piece as an item of ``fetch_cached``: unique ids with the versions held (looked
        up now, when the request leaves, after the pushes it is ordered after), the bound and
        the cache's writer token."""
        if self.cache is None:
            return (self.table, self.ids, None, 0, 0, 0)
        unique, inverse, counts = torch.unique(self.ids, return_inverse=True, return_counts=True)
        self.lookup = self.cache.lookup(self.shard, unique, counts)
        self.inverse = inverse
        lookup = self.lookup
        return (self.table, unique, lookup.held, lookup.epoch, lookup.bound, self.cache.writer)

    def rows(self, answer: Any, counts: FetchCounts) -> torch.Tensor:
        """The piece's rows from its server's answer, counted into ``counts``."""
        if self.lookup is None or self.cache is None or self.inverse is None:
            counts.rows += answer.shape[0]
            counts.bytes += answer.numel() * answer.element_size()
            return answer
        versioned = VersionedRows(*answer)
        rows, served, missed = self.cache.merge(self.lookup, versioned)
        counts.rows += versioned.rows.shape[0]
        counts.bytes += versioned.nbytes
        counts.lookups += self.inverse.numel()
        counts.hits += int(served.index_select(0, self.inverse).sum())
        counts.staleness_max = max(counts.staleness_max, missed)
        return rows.index_select(0, self.inverse)


def _fetch_call(client: Client, server: str, pieces: Sequence[_Piece]) -> Future:
    """One request asking ``server`` for ``pieces``: ``fetch_cached`` when one is of a cached
    table, else ``fetch`` (one piece) or ``fetch_many``."""
    what = f"fetch of {', '.join(repr(p.table) for p in pieces)}"
    args: tuple[Any, ...]
    if any(p.cache is not None for p in pieces):
        op, args = "fetch_cached", ([p.cache_request() for p in pieces],)
    elif len(pieces) == 1:
        op, args = "fetch", (pieces[0].table, pieces[0].ids)
    else:
        op, args = "fetch_many", ([(p.table, p.ids) for p in pieces],)
    return client.call(server, op, args, what=what, timeout_s=client.timeout_s)


def _fetch(requests: Sequence[tuple[str, Ids]], *, single: bool) -> FetchFuture:
    client = current()
    resolved = []
    for table, ids in requests:
        route = client.route(table)
        resolved.append((table, _as_ids(route, ids), route))
    per_server: dict[str, list[_Piece]] = {}
    for index, (table, ids, route) in enumerate(resolved):
        cache = client.caches.get(table)
        for shard, pos, shard_ids in _split(ids, len(route.servers)):
            piece = _Piece(index, pos, table, shard_ids, shard, cache)
            per_server.setdefault(route.servers[shard], []).append(piece)
    tables = [t for t, _, _ in resolved]
    label = f"ps.fetch:{tables[0]}" if single else f"ps.fetch_many:{'+'.join(tables)}"
    out = FetchFuture(
        tuple((t, ids) for t, ids, _ in resolved),
        single=single,
        label=label,
        stale=in_stale_reads(),
    )
    plan = list(per_server.items())

    def start() -> Future:
        return gather([_fetch_call(client, server, pieces) for server, pieces in plan])

    def finish(answers: list[Any]) -> Any:
        counts = FetchCounts()
        results = [torch.empty(ids.numel(), route.spec.dim) for _, ids, route in resolved]
        for (_, pieces), answer in zip(plan, answers, strict=True):
            batched = len(pieces) > 1 or any(p.cache is not None for p in pieces)
            for piece, got in zip(pieces, answer if batched else [answer], strict=True):
                rows = piece.rows(got, counts)
                if piece.pos is None:
                    results[piece.index] = rows
                else:
                    results[piece.index].index_copy_(0, piece.pos, rows)
        client.count_fetched(counts)
        shaped = [
            r.reshape(*ids.shape, route.spec.dim)
            for r, (_, ids, route) in zip(results, resolved, strict=True)
        ]
        if client.device.type == "cuda":
            shaped = _to_device(shaped, client, out)
        return shaped[0] if single else shaped

    with client.lock:
        writes = client.order.fetch(tables, out)
    after(out, writes=writes, reads=(), start=start, finish=finish, what=label)
    return out


def _to_device(rows: list[torch.Tensor], client: Client, out: FetchFuture) -> list[torch.Tensor]:
    """``rows`` copied to the client's GPU through pinned buffers on the copy stream (not waited:
    :meth:`FetchFuture.leaves` orders the consumer's stream after ``out.copied``)."""
    with torch.cuda.stream(client.copy_stream):
        moved = []
        for r in rows:
            pinned = torch.empty(r.shape, dtype=r.dtype, pin_memory=True)
            pinned.copy_(r)
            moved.append(pinned.to(client.device, non_blocking=True))
        event = torch.cuda.Event()
        event.record(client.copy_stream)
    out.copied = event
    return moved


# --- push --------------------------------------------------------------------------------------


def push_async(table: str, ids: Ids, grads: torch.Tensor, lr: float) -> Future:
    """Issue a sparse optimizer step on rows ``ids`` with gradient rows ``grads`` (``[*ids.shape, dim]``);
    duplicate ids accumulate on the server before the update. Resolve with :func:`wait`."""
    return push_many_async([(table, ids, grads)], lr)


def push_many_async(
    pushes: Sequence[tuple[str, Ids, torch.Tensor]], lr: float, *, dry_run: bool = False
) -> Future:
    """Several ``(table, ids, grads)`` pushes as one request per server (one latency and one
    serialization instead of one per table), each table ordered as by :func:`push_async`. A server
    checks every table and row before applying any; if the request still fails, later operations
    of each of its tables fail (their state is unknown). Resolve with :func:`wait`.

    ``dry_run``: the same requests, ordered the same way and heard by the push listeners (a
    pipeline's staleness journal) alike, but the servers run the update's kernels on the rows,
    writing back what was there, and change nothing (``push_dry_run``), and no cache takes it:
    the cost model rehearses a step's push this way (a push is never sent twice).
    """
    client = current()
    named, per_server, shards = _push_plan(client, pushes)
    tables = [table for table, _ in named]
    out: Future = Future()
    out.label = label = f"ps.push:{'+'.join(tables)}"  # type: ignore[attr-defined]
    plan = list(per_server.items())
    cached = not dry_run and any(table in client.caches for table in tables)

    def start() -> Future:
        """One request per server: ``push`` for one item, else ``push_many``. Gradient rows
        travel packed where consecutive rows are equal (:func:`pack_rows`: a pooled bag's rows
        share one gradient). With a cache the items carry its writer token (0: an uncached
        table), and the servers answer the versions each push was applied to."""
        requests = []
        for server, items in plan:
            what = f"push to {', '.join(repr(table) for table, _, _ in items)}"
            writers = [_writer(client, table) for table, _, _ in items] if cached else None
            wire = [(table, ids, pack_rows(rows)) for table, ids, rows in items]
            args: tuple[Any, ...]
            if dry_run:
                op, args = "push_dry_run", (wire, float(lr))  # the bytes a push sends
            elif len(items) == 1:
                op = "push"
                args = (*wire[0], float(lr), *(writers or ()))
            else:
                op, args = "push_many", (wire, float(lr), writers)
            requests.append(client.call(server, op, args, what=what, timeout_s=client.timeout_s))
        return gather(requests)

    def finish(answers: list[Any]) -> None:
        """The cached tables' copies take the push the servers took (before the push is done:
        a fetch ordered after it finds them updated)."""
        if not cached:
            return
        for (server, items), answer in zip(plan, answers, strict=True):
            applied = [answer] if len(items) == 1 else answer
            for (table, ids, rows), shard, (epoch, before, run) in zip(
                items, shards[server], applied, strict=True
            ):
                cache = client.caches.get(table)
                if cache is not None:
                    cache.apply_own(shard, ids, rows, float(lr), epoch, before, run)

    for listener in list(client.push_listeners):
        for table, flat in named:
            listener(table, flat)
    with client.lock:
        writes, reads = client.order.push(tables, out)
    after(out, writes=writes, reads=reads, start=start, finish=finish, what=label)
    return out


_PerServer = dict[str, list[tuple[str, torch.Tensor, torch.Tensor]]]


def _push_plan(
    client: Client, pushes: Sequence[tuple[str, Ids, torch.Tensor]]
) -> tuple[list[tuple[str, torch.Tensor]], _PerServer, dict[str, list[int]]]:
    """The pushes checked and split by server: ``(table, flat ids)`` per push, the
    ``(table, ids, rows)`` items of each server's request, and the shard of each item."""
    named: list[tuple[str, torch.Tensor]] = []  # (table, flat ids), for the push listeners
    per_server: _PerServer = {}
    shards: dict[str, list[int]] = {}  # the shard of each item of per_server
    for table, ids, grads in pushes:
        route = client.route(table)
        flat = _as_ids(route, ids).reshape(-1)
        if not isinstance(grads, torch.Tensor) or not grads.is_floating_point():
            raise ConfigError(
                f"push to {table!r}: grads must be a float tensor, got {type(grads).__name__}"
            )
        if grads.numel() != flat.numel() * route.spec.dim:
            raise ConfigError(
                f"push to {table!r}: grads of shape {tuple(grads.shape)} do not match {flat.numel()} ids "
                f"of dim {route.spec.dim}"
            )
        # Sent from host memory, contiguous: a cache applies the rows as the server receives them.
        rows = grads.detach().reshape(-1, route.spec.dim).to("cpu").contiguous()
        for shard, pos, shard_ids in _split(flat, len(route.servers)):
            shard_rows = rows if pos is None else rows.index_select(0, pos)
            server = route.servers[shard]
            per_server.setdefault(server, []).append((table, shard_ids, shard_rows))
            shards.setdefault(server, []).append(shard)
        named.append((table, flat))
    return named, per_server, shards


def _writer(client: Client, table: str) -> int:
    """The writer token of ``table``'s cache, 0 for an uncached table."""
    cache = client.caches.get(table)
    return 0 if cache is None else cache.writer


def push(table: str, ids: Ids, grads: torch.Tensor, lr: float) -> None:
    """Blocking :func:`push_async`."""
    wait(push_async(table, ids, grads, lr))


def step_pushes() -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """What :func:`push_gradients` would push now: per table of this thread's step, the ids of
    every row fetched with a gradient and those gradients (the step's records stay)."""
    by_table: dict[str, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
    for rec in context.current():
        if rec.rows.grad is None:
            continue  # fetched but unused by the loss
        ids, grads = by_table.setdefault(rec.table, ([], []))
        ids.append(rec.ids)
        grads.append(rec.rows.grad.reshape(rec.ids.numel(), -1))
    return [(t, torch.cat(ids), torch.cat(grads)) for t, (ids, grads) in by_table.items()]


def push_gradients(*, lr: float, blocking: bool = False) -> list[Future]:
    """Push the gradients of every row fetched in this thread's step, then clear the step.

    Call after ``loss.backward()``. One batched push (:func:`push_many_async`: one request per
    server) of every table, ids concatenated per table; duplicates accumulate on the server. With
    ``blocking=False`` the push overlaps what follows (the next step's fetches of a table are
    ordered after it); returns its future (none when nothing was fetched with a gradient).
    """
    pushes = step_pushes()
    context.take()
    if not pushes:
        return []
    futures = [push_many_async(pushes, lr)]
    if blocking:
        for fut in futures:
            wait(fut)
    return futures
