"""One parameter server: the table shards it holds and every operation a trainer may ask of it.

The same object serves on both transports: the RPC server process
(:mod:`distopt.ps.cluster.rpc_process`) and a Ray actor (:mod:`distopt.ps.transport.ray_actor`)
each hold one and dispatch every call through :meth:`ParameterServer.answer`, so fetches,
pushes, checkpoints, statistics and latency injection are one code path, and a checkpoint written
on one backend loads on the other. The operations are the methods marked with
:func:`~distopt.ps.server.operation.operation`; :data:`OPERATIONS` lists them.

Calls run on the transport's thread pool (RPC handler threads, a threaded actor's
``max_concurrency``): each table shard guards itself with a lock, the counters with theirs.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import threading
import time
from collections import Counter
from collections.abc import Sequence
from typing import Any

import torch

from distopt.ps.server.operation import Operation, operation, operations
from distopt.ps.server.shard_files import read_shards, write_shards
from distopt.ps.server.table import Grads, ShardTable, grads_nbytes
from distopt.ps.spec import ServerOptions, TableSpec, server_name, trainer_name


class ServerRestarted(RuntimeError):
    """A server Ray restarted refuses fetches, pushes and saves until :func:`distopt.ps.recover`."""


class ParameterServer:
    """Server ``index`` of a job: its shards, injected latency, request counts and trainers."""

    def __init__(self, index: int, tables: tuple[TableSpec, ...], options: ServerOptions) -> None:
        self.index = index
        self.name = server_name(index)
        self.specs = tables
        self.options = options
        self.latency_s = options.latency_ms / 1000.0
        self.shards = self._seeded_shards()
        self.counts: Counter[str] = Counter()
        self.counts_lock = threading.Lock()
        """Guards ``counts`` and the trainer bookkeeping below."""
        self.num_trainers = 0
        """Trainers of an RPC job (:meth:`expect_trainers`); the server stops once all are done."""
        self.finished: set[str] = set()
        self.last_seen: dict[str, float] = {}
        """Trainer name → ``time.monotonic()`` of its last heartbeat."""
        self.stop = threading.Event()
        """Set once every trainer said it is done."""
        self.fence = ""
        """Set when Ray restarted this server: what it reloaded. Fenced calls are refused
        (:class:`ServerRestarted`) until an operation that replaces every shard succeeds."""

    def _seeded_shards(self) -> dict[str, ShardTable]:
        """The shards this server holds, at their seeded initial values."""
        shards = {}
        for spec in self.specs:
            placement = spec.placement(self.options.num_servers)
            if self.index in placement:
                shards[spec.name] = ShardTable(
                    spec,
                    shard=placement.index(self.index),
                    num_shards=len(placement),
                    seed=self.options.seed,
                )
        return shards

    def table(self, name: str) -> ShardTable:
        shard = self.shards.get(name)
        if shard is None:
            held = ", ".join(sorted(self.shards)) or "none"
            raise KeyError(f"{self.name} holds no table {name!r} (held: {held})")
        return shard

    def answer(self, op: Operation, args: Sequence[Any]) -> Any:
        """Run ``op`` with ``args``: how both transports dispatch every call."""
        if op.fenced and self.fence:
            raise ServerRestarted(f"{self.fence}; call distopt.ps.recover() to reload every server")
        start = time.thread_time_ns()
        result = op.method(self, *args)
        cpu_us = (time.thread_time_ns() - start) // 1000
        with self.counts_lock:
            self.counts[f"cpu_us_{op.name}"] += cpu_us
        if op.unfences:
            self.fence = ""
        return result

    def begin(self, op: str) -> None:
        """Count the request, then emulate network/server latency before doing the work."""
        with self.counts_lock:
            self.counts[op] += 1
            self.counts["requests"] += 1
        if self.latency_s:
            time.sleep(self.latency_s)

    def count(self, kind: str, rows: int, nbytes: int) -> None:
        """Count ``rows`` rows and ``nbytes`` bytes of tensors ``served`` (fetch answers) or
        ``pushed`` (gradients received)."""
        with self.counts_lock:
            self.counts[f"rows_{kind}"] += rows
            self.counts[f"bytes_{kind}"] += nbytes

    # --- rows ------------------------------------------------------------------------------------

    @operation(read=True, fenced=True)
    def fetch(self, table: str, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` (global ids held by this server) of ``table``."""
        self.begin("fetch")
        rows = self.table(table).fetch(ids)
        self.count("served", rows.shape[0], rows.numel() * rows.element_size())
        return rows

    @operation(read=True, fenced=True)
    def fetch_many(self, requests: list[tuple[str, torch.Tensor]]) -> list[torch.Tensor]:
        """Several fetches in one request: one latency, one round trip, results in request order."""
        self.begin("fetch_many")
        answers = [self.table(table).fetch(ids) for table, ids in requests]
        self.count(
            "served",
            sum(rows.shape[0] for rows in answers),
            sum(rows.numel() * rows.element_size() for rows in answers),
        )
        return answers

    @operation(read=True, fenced=True)
    def fetch_cached(
        self,
        requests: list[tuple[str, torch.Tensor, torch.Tensor | None, int, int | torch.Tensor, int]],
    ) -> list[torch.Tensor | tuple[Any, ...]]:
        """Fetches of a trainer with row caches, in one request: per ``(table, ids, held,
        epoch, bound, writer)``, with ``held`` the versions its cache holds (``None``: an
        uncached table, answered as by :meth:`fetch`), ``bound`` the other writers' pushes a
        served row may lack (one for all rows, or per row) and ``writer`` the cache's token, the
        rows it must take as the fields of a :class:`~distopt.ps.server.table.VersionedRows` (a
        plain tuple: Ray sends its tensors as arrays)."""
        self.begin("fetch_cached")
        answers: list[torch.Tensor | tuple[Any, ...]] = []
        rows = nbytes = 0
        for table, ids, held, epoch, bound, writer in requests:
            shard = self.table(table)
            if held is None:
                plain = shard.fetch(ids)
                answers.append(plain)
                rows += plain.shape[0]
                nbytes += plain.numel() * plain.element_size()
            else:
                limit = bound if isinstance(bound, torch.Tensor) else int(bound)
                versioned = shard.fetch_versioned(ids, held, int(epoch), limit, int(writer))
                answers.append(versioned.fields())
                rows += versioned.rows.shape[0]
                nbytes += versioned.nbytes
        self.count("served", rows, nbytes)
        return answers

    @operation(fenced=True)
    def push(
        self,
        table: str,
        ids: torch.Tensor,
        grads: Grads,
        lr: float,
        writer: int | None = None,
    ) -> tuple[int, torch.Tensor, torch.Tensor] | None:
        """Apply the table's sparse optimizer step to rows ``ids`` with gradient rows ``grads``
        (``[n, dim]``, or packed: :func:`~distopt.ps.server.table.pack_rows`); with a ``writer``
        (the pushing cache's token, 0 for none), answer the shard's epoch, the rows' versions
        before it and where the writer's run of pushes began (for the trainer's cache)."""
        self.begin("push")
        answer = self.table(table).push(ids, grads, float(lr), int(writer or 0))
        self.count("pushed", ids.numel(), grads_nbytes(grads))
        return answer if writer is not None else None

    @operation(fenced=True)
    def push_many(
        self,
        pushes: list[tuple[str, torch.Tensor, Grads]],
        lr: float,
        writers: list[int] | None = None,
    ) -> list[tuple[int, torch.Tensor, torch.Tensor]] | None:
        """Several pushes in one request (one latency), applied in request order; ``writers``
        (one per push) as ``writer`` for :meth:`push`, one answer per push.

        Every table, row and gradient shape is checked before any is updated: a bad request
        changes nothing.
        """
        self.begin("push_many")
        checked = [
            (self.table(table), *self.table(table).checked(ids, grads))
            for table, ids, grads in pushes
        ]
        tokens = [0] * len(checked) if writers is None else [int(w) for w in writers]
        if len(tokens) != len(checked):
            raise ValueError(f"push_many: {len(tokens)} writers for {len(checked)} pushes")
        answers = [
            shard.apply(local, rows, float(lr), token)
            for (shard, local, rows), token in zip(checked, tokens, strict=True)
        ]
        self.count(
            "pushed",
            sum(local.numel() for _, local, _ in checked),
            sum(grads_nbytes(grads) for _, _, grads in pushes),
        )
        return answers if writers is not None else None

    @operation(read=True, fenced=True)
    def push_dry_run(self, pushes: list[tuple[str, torch.Tensor, Grads]], lr: float) -> None:
        """:meth:`push_many`'s request, latency, checks and update kernels on the same rows,
        writing back what was there (:meth:`ShardTable.rehearse`): nothing changes (the cost
        model times a push this way; a push itself is never sent twice)."""
        self.begin("push_dry_run")
        checked = [
            (self.table(table), *self.table(table).checked(ids, grads))
            for table, ids, grads in pushes
        ]
        for shard, local, rows in checked:
            shard.rehearse(local, rows, float(lr))

    # --- whole shards: checkpoints -----------------------------------------------------------------

    @operation(read=True)
    def state_dict(self) -> dict[str, dict[str, Any]]:
        """This server's shards: ``{table: shard_state}`` (see :meth:`ShardTable.state_dict`)."""
        return {name: shard.state_dict() for name, shard in self.shards.items()}

    @operation(unfences=True)
    def load_state_dict(self, state: dict[str, dict[str, Any]]) -> None:
        """Restore every shard held here from :meth:`state_dict` output."""
        self._load_state(self.shards, state)

    @operation(fenced=True)  # a restarted shard beside later ones is no checkpoint
    def save(self, directory: str) -> tuple[str, int]:
        """Write every shard held here (weights and optimizer state) to ``<directory>/ps<i>.pt``,
        atomically; returns the file's name and size. Each server writes its own file, so a
        checkpoint's table data never travels through a trainer."""
        path = write_shards(directory, self.index, self.options.num_servers, self.state_dict())
        return path.name, path.stat().st_size

    @operation(unfences=True)
    def load(self, directory: str) -> None:
        """Restore every shard held here from ``<directory>/ps<i>.pt`` (written by :meth:`save`
        in a job with the same number of servers, on either backend)."""
        self._load_state(self.shards, read_shards(directory, self.index, self.options.num_servers))

    @operation(unfences=True, transports=("ray",))
    def restore(self, directory: str | None) -> str:
        """Reload every shard from checkpoint ``directory`` (``None``: the seeded initial tables)
        and answer fenced calls again (:func:`distopt.ps.recover`); what was loaded, in words.

        The shards are loaded aside and swapped in whole: a failed load leaves nothing half-done.
        Request counts and the injected latency stay.
        """
        shards = self._seeded_shards()
        if directory is not None:
            self._load_state(shards, read_shards(directory, self.index, self.options.num_servers))
        self.shards = shards
        return directory or "seeded"

    def _load_state(self, shards: dict[str, ShardTable], state: dict[str, dict[str, Any]]) -> None:
        missing = sorted(set(shards) - set(state))
        if missing:
            raise KeyError(f"{self.name}: checkpoint lacks table {missing[0]!r}")
        for name, shard_state in state.items():
            shard = shards.get(name)
            if shard is None:
                held = ", ".join(sorted(shards)) or "none"
                raise KeyError(f"{self.name} holds no table {name!r} (held: {held})")
            shard.load_state_dict(shard_state)

    # --- what the server is --------------------------------------------------------------------

    @operation(read=True)
    def tables(self) -> list[dict[str, Any]]:
        """Specs of the tables this server holds (the client builds its routing from them)."""
        return [dataclasses.asdict(shard.spec) for shard in self.shards.values()]

    @operation(read=True)
    def stats(self) -> dict[str, int]:
        """Request counts by operation since start (``requests`` is the total), rows and bytes
        of tensors served (``rows_served``, ``bytes_served``) and received in pushes
        (``rows_pushed``, ``bytes_pushed``), the CPU microseconds the handlers of each operation
        took (``cpu_us_<op>``: the thread's CPU time, not the injected latency, nor the
        transport's work around the handler), the whole process's CPU microseconds (``cpu_us``:
        every thread, the transport's too) and the PID."""
        with self.counts_lock:
            counts = {**self.counts}
        return {**counts, "cpu_us": int(time.process_time() * 1e6), "pid": os.getpid()}

    @operation()
    def set_latency(self, latency_ms: float) -> float:
        """Change the injected latency (benchmarks compare with a network-free reference on the
        same servers); returns the previous value in milliseconds."""
        previous, self.latency_s = self.latency_s * 1000.0, latency_ms / 1000.0
        return previous

    @operation(read=True, transports=("ray",))
    def incarnation(self) -> dict[str, Any]:
        """This server's process and, after a restart, what it reloaded (``fenced``: it refuses
        fenced calls until :meth:`restore`)."""
        return {"pid": os.getpid(), "fenced": bool(self.fence), "note": self.fence}

    # --- the trainers of an RPC server process -----------------------------------------------------
    # Ray actors belong to the process that created them (they die with it): no heartbeats there.

    @operation(transports=("rpc",))
    def heartbeat(self, trainer: str) -> None:
        """``trainer`` is alive (sent every ``trainer_timeout_s / 5`` by its heartbeat thread)."""
        with self.counts_lock:
            self.last_seen[trainer] = time.monotonic()

    @operation(transports=("rpc",))
    def trainer_done(self, trainer: str) -> None:
        """``trainer`` has finished with this server; once every trainer has, :attr:`stop` is set."""
        with self.counts_lock:
            self.finished.add(trainer)
            if len(self.finished) >= self.num_trainers:
                self.stop.set()

    @operation(transports=("rpc",))
    def abort(self, reason: str) -> None:
        """A trainer failed: exit with status 1 shortly after answering (``distopt.ps.abort``).

        Otherwise the servers would wait for the failed trainer until ``trainer_timeout_s``, and
        the job (and its TorchX status) with them.
        """
        print(
            f"distopt.ps.server: error: {self.name}: parameter server aborting: {reason}",
            file=sys.stderr,
            flush=True,
        )
        threading.Timer(0.2, os._exit, args=(1,)).start()

    def expect_trainers(self, num_trainers: int) -> None:
        """Serve ``num_trainers`` trainers: :attr:`stop` is set once each said it is done."""
        with self.counts_lock:
            self.num_trainers = num_trainers

    def start_listening(self) -> None:
        """Every expected trainer counts as heard from now (see :meth:`silent_trainers`)."""
        now = time.monotonic()
        with self.counts_lock:
            for j in range(self.num_trainers):
                self.last_seen.setdefault(trainer_name(j), now)

    def silent_trainers(self, timeout_s: float) -> list[tuple[str, float]]:
        """``(trainer, seconds quiet)`` of the trainers not done that sent nothing for ``timeout_s``."""
        with self.counts_lock:
            now = time.monotonic()
            return [
                (name, now - seen)
                for name, seen in sorted(self.last_seen.items())
                if name not in self.finished and now - seen > timeout_s
            ]


OPERATIONS: dict[str, Operation] = operations(ParameterServer)
"""Every operation a server answers, by name (see :mod:`distopt.ps.server.operation`)."""
