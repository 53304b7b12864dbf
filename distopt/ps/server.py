"""The parameter-server process: holds table shards and answers RPCs (TensorPipe).

Run by :func:`distopt.ps.launch.start_servers` as ``python -m distopt.ps.server CONFIG_JSON``, and
by ``distopt.train``'s ``ps`` role (:mod:`distopt.job.ps_roles`) through :func:`serve`. Server ``i``
joins the RPC group as ``ps{i}`` with rank ``num_trainers + i``; trainer ``j`` has rank ``j`` (a
process can hold only one RPC rank in its life, see ``launch.init_trainer``). The config's store
plan (:class:`distopt.rendezvous.StorePlan`) says who hosts the job's stores: the launcher for
``start_servers``, ``ps0`` for ``distopt.train``; a hosting server keeps them until every trainer
has left. A server exits with status 0 once every trainer has said it is done, with 1 when a
trainer aborts the job or falls silent, with 3 when the launcher that started it dies.

The ``ps_server_*`` functions below are the RPC handlers; clients call them through
``rpc_async(server, ps_server_fetch, args=(table, ids))``. They run on the RPC thread pool, so each
table shard guards itself with a lock. Handlers that only read are registered with
:func:`distopt.remote.register_read`, so a user's raw ``rpc_sync("ps0", ps_server_fetch, ...)`` is
scheduled as a read.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import torch

from distopt.atomic import atomic_torch_save
from distopt.errors import ConfigError, RemoteCallError
from distopt.ps.spec import ServerOptions, TableSpec, server_name, trainer_name
from distopt.ps.table import ShardTable
from distopt.remote import register_read


class _ServerState:
    """Shards held by this process, the injected latency, and request counters."""

    def __init__(self, index: int, tables: tuple[TableSpec, ...], options: ServerOptions) -> None:
        self.index = index
        self.name = server_name(index)
        self.options = options
        self.latency_s = options.latency_ms / 1000.0
        self.shards: dict[str, ShardTable] = {}
        for spec in tables:
            placement = spec.placement(options.num_servers)
            if index in placement:
                self.shards[spec.name] = ShardTable(
                    spec, shard=placement.index(index), num_shards=len(placement), seed=options.seed
                )
        self.counts: Counter[str] = Counter()
        self.counts_lock = threading.Lock()
        self.num_trainers = 0
        self.finished: set[str] = set()
        self.stop = threading.Event()
        self.last_seen: dict[str, float] = {}
        """Trainer name → ``time.monotonic()`` of its last heartbeat (see :func:`watch_trainers`)."""

    def table(self, name: str) -> ShardTable:
        shard = self.shards.get(name)
        if shard is None:
            held = ", ".join(sorted(self.shards)) or "none"
            raise KeyError(f"{self.name} holds no table {name!r} (held: {held})")
        return shard

    def begin(self, op: str) -> None:
        """Count the request, then emulate network/server latency before doing the work."""
        with self.counts_lock:
            self.counts[op] += 1
            self.counts["requests"] += 1
        if self.latency_s:
            time.sleep(self.latency_s)

    # --- the operations a client asks for; the RPC handlers below and the Ray actor
    # (distopt.ps.ray_server) both delegate here, so the two backends cannot drift apart.

    def fetch(self, table: str, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` (global ids held by this server) of ``table``."""
        self.begin("fetch")
        return self.table(table).fetch(ids)

    def fetch_many(self, requests: list[tuple[str, torch.Tensor]]) -> list[torch.Tensor]:
        """Several fetches in one request: one latency, one round trip, results in request order."""
        self.begin("fetch_many")
        return [self.table(table).fetch(ids) for table, ids in requests]

    def push(self, table: str, ids: torch.Tensor, grads: torch.Tensor, lr: float) -> None:
        """Apply the table's sparse optimizer step to rows ``ids``."""
        self.begin("push")
        self.table(table).push(ids, grads, float(lr))

    def push_many(self, pushes: list[tuple[str, torch.Tensor, torch.Tensor]], lr: float) -> None:
        """Several pushes in one request (one latency), applied in request order. Every table, row and
        gradient shape is checked before any is updated: a bad request changes nothing."""
        self.begin("push_many")
        checked = [(self.table(table), *self.table(table).checked(ids, grads)) for table, ids, grads in pushes]
        for shard, local, rows in checked:
            shard.apply(local, rows, float(lr))

    def state_dict(self) -> dict[str, dict[str, Any]]:
        """This server's shards: ``{table: shard_state}`` (see :meth:`ShardTable.state_dict`)."""
        return {name: shard.state_dict() for name, shard in self.shards.items()}

    def load_state_dict(self, state: dict[str, dict[str, Any]]) -> None:
        """Restore every shard held here from :meth:`state_dict` output."""
        missing = sorted(set(self.shards) - set(state))
        if missing:
            raise KeyError(f"{self.name}: checkpoint lacks table {missing[0]!r}")
        for name, shard_state in state.items():
            self.table(name).load_state_dict(shard_state)

    def save(self, directory: str) -> tuple[str, int]:
        """Write every shard held here (weights and optimizer state) to ``<directory>/ps<i>.pt``,
        atomically; returns the file's name and size. Each server writes its own file, so a
        checkpoint's table data never travels through a trainer."""
        payload = {
            "server": self.name,
            "num_servers": self.options.num_servers,
            "tables": self.state_dict(),
        }
        path = atomic_torch_save(payload, shard_file(directory, self.index))
        return path.name, path.stat().st_size

    def load(self, directory: str) -> None:
        """Restore every shard held here from ``<directory>/ps<i>.pt`` (written by :meth:`save`
        in a job with the same number of servers, on either backend)."""
        path = shard_file(directory, self.index)
        try:
            payload = torch.load(path, map_location="cpu", weights_only=True)
        except (OSError, RuntimeError) as err:
            raise ConfigError(f"{self.name}: cannot load checkpoint {path}: {err}") from None
        if payload.get("num_servers") != self.options.num_servers:
            raise ConfigError(
                f"{self.name}: checkpoint {path} was written by {payload.get('num_servers')} servers, "
                f"this job has {self.options.num_servers} (resharding is not supported)"
            )
        self.load_state_dict(payload["tables"])

    def tables(self) -> list[dict[str, Any]]:
        """Specs of the tables this server holds (the client builds its routing from them)."""
        return [dataclasses.asdict(shard.spec) for shard in self.shards.values()]

    def stats(self) -> dict[str, int]:
        """Request counts by operation since start (``requests`` is the total), and the PID."""
        with self.counts_lock:
            return {**self.counts, "pid": os.getpid()}

    def set_latency(self, latency_ms: float) -> float:
        """Change the injected latency; returns the previous value in milliseconds."""
        previous, self.latency_s = self.latency_s * 1000.0, latency_ms / 1000.0
        return previous


def shard_file(directory: str | Path, index: int) -> Path:
    """The file server ``index`` writes its shards to in checkpoint ``directory``."""
    return Path(directory) / f"{server_name(index)}.pt"


_STATE: _ServerState | None = None


def _state() -> _ServerState:
    if _STATE is None:
        raise RuntimeError("this process is not a distopt parameter server")
    return _STATE


@register_read
def ps_server_fetch(table: str, ids: torch.Tensor) -> torch.Tensor:
    """Rows ``ids`` (global ids held by this server) of ``table``."""
    return _state().fetch(table, ids)


@register_read
def ps_server_fetch_many(requests: list[tuple[str, torch.Tensor]]) -> list[torch.Tensor]:
    """Several fetches in one request: one latency, one round trip, results in request order."""
    return _state().fetch_many(requests)


def ps_server_push(table: str, ids: torch.Tensor, grads: torch.Tensor, lr: float) -> None:
    """Apply the table's sparse optimizer step to rows ``ids``."""
    _state().push(table, ids, grads, lr)


def ps_server_push_many(pushes: list[tuple[str, torch.Tensor, torch.Tensor]], lr: float) -> None:
    """Several pushes in one request: one latency, one round trip, applied in request order."""
    _state().push_many(pushes, lr)


@register_read
def ps_server_state_dict() -> dict[str, dict[str, Any]]:
    """This server's shards: ``{table: shard_state}`` (see :meth:`ShardTable.state_dict`)."""
    return _state().state_dict()


def ps_server_load_state_dict(state: dict[str, dict[str, Any]]) -> None:
    """Restore every shard held here from :func:`ps_server_state_dict` output."""
    _state().load_state_dict(state)


def ps_server_save(directory: str) -> tuple[str, int]:
    """Write this server's shards to ``<directory>/ps<i>.pt`` (:meth:`_ServerState.save`)."""
    return _state().save(directory)


def ps_server_load(directory: str) -> None:
    """Restore this server's shards from ``<directory>/ps<i>.pt`` (:meth:`_ServerState.load`)."""
    _state().load(directory)


def ps_server_heartbeat(trainer: str) -> None:
    """``trainer`` is alive (sent every ``trainer_timeout_s / 5`` by its heartbeat thread)."""
    state = _state()
    with state.counts_lock:
        state.last_seen[trainer] = time.monotonic()


def watch_trainers(state: _ServerState, timeout_s: float) -> None:
    """Exit the process with status 1 when a trainer that has not finished goes silent.

    A killed trainer never says it is done, so without this the servers would wait for it forever.
    """
    now = time.monotonic()
    with state.counts_lock:
        for j in range(state.num_trainers):
            state.last_seen.setdefault(trainer_name(j), now)

    def watch() -> None:
        while not state.stop.wait(min(1.0, timeout_s / 4)):
            with state.counts_lock:
                now = time.monotonic()
                silent = [
                    (name, now - seen)
                    for name, seen in sorted(state.last_seen.items())
                    if name not in state.finished and now - seen > timeout_s
                ]
            if silent:
                name, quiet = silent[0]
                print(
                    f"distopt.ps.server: error: {state.name}: {name} sent nothing for {quiet:.1f} s "
                    f"(ps.trainer_timeout_s={timeout_s:g}): killed or stuck; exiting",
                    file=sys.stderr,
                    flush=True,
                )
                os._exit(1)

    threading.Thread(target=watch, name="distopt-ps-trainer-watch", daemon=True).start()


@register_read
def ps_server_tables() -> list[dict[str, Any]]:
    """Specs of the tables this server holds (the client builds its routing from them)."""
    return _state().tables()


def ps_server_abort(reason: str) -> None:
    """A trainer failed: exit with status 1 shortly after answering (``distopt.ps.abort``).

    Otherwise the servers would wait for the failed trainer until ``trainer_timeout_s``, and the
    job (and its TorchX status) with them.
    """
    name = _state().name
    print(f"distopt.ps.server: error: {name}: parameter server aborting: {reason}", file=sys.stderr, flush=True)
    threading.Timer(0.2, os._exit, args=(1,)).start()


def ps_server_trainer_done(trainer: str) -> None:
    """``trainer`` has finished with this server; once every trainer has, the server exits."""
    state = _state()
    with state.counts_lock:
        state.finished.add(trainer)
        if len(state.finished) >= state.num_trainers:
            state.stop.set()


@register_read
def ps_server_stats() -> dict[str, int]:
    """Request counts by operation since start (``requests`` is the total), and the PID."""
    return _state().stats()


def ps_server_set_latency(latency_ms: float) -> float:
    """Change the injected latency (benchmarks compare with a network-free reference on the same
    servers); returns the previous value in milliseconds."""
    return _state().set_latency(latency_ms)


def serve(config: dict[str, Any]) -> None:
    """Join the RPC group as a parameter server and serve until every trainer is done."""
    global _STATE

    from distopt import rendezvous

    options = ServerOptions(**config["options"])
    tables = tuple(TableSpec(**lists_as_tuples(t)) for t in config["tables"])
    plan = rendezvous.StorePlan(**config["plan"])
    index = int(config["index"])
    name = server_name(index)
    # Handlers are small index_select/index_add calls: one intra-op thread each avoids
    # oversubscribing the cores that trainers and other servers share.
    torch.set_num_threads(1)
    _exit_with_launcher(config.get("launcher_pid"))
    _STATE = _ServerState(index, tables, options)
    num_trainers = int(config["world_size"]) - options.num_servers
    _STATE.num_trainers = num_trainers
    trainers = [trainer_name(j) for j in range(num_trainers)]
    with rendezvous.host_stores(plan, me=name, timeout_s=options.join_timeout_s) as hosted:
        rendezvous.meet(plan, me=name, others=trainers, timeout_s=options.join_timeout_s)
        rendezvous.init_rpc(
            plan, name=name, rank=int(config["rank"]), world_size=int(config["world_size"]),
            transport=options, timeout_s=options.join_timeout_s,
        )  # fmt: skip
        watch_trainers(_STATE, options.trainer_timeout_s)
        # Serve until every trainer said it is done, then leave together with them.
        _STATE.stop.wait()
        rendezvous.leave_rpc(me=name, graceful=True)
        # Trainers mark themselves left in the RPC store after leaving the group: a hosting server
        # keeps the stores up until they have (bounded, in case one died after saying it was done).
        late = hosted.wait_until_left(trainers, timeout_s=options.rpc_timeout_s)
    if late:
        print(f"distopt.ps.server: {name}: closed the job's stores before {', '.join(late)} left "
              f"(waited ps.rpc_timeout_s={options.rpc_timeout_s:g})", file=sys.stderr, flush=True)  # fmt: skip


def _exit_with_launcher(launcher_pid: int | None) -> None:
    """Exit when the launching process dies (crash, SIGKILL): never leave an orphan server behind."""
    if launcher_pid is None:
        return

    def watch() -> None:
        while os.getppid() == launcher_pid:
            time.sleep(0.5)
        os._exit(3)

    threading.Thread(target=watch, name="distopt-ps-launcher-watch", daemon=True).start()


def lists_as_tuples(data: dict[str, Any]) -> dict[str, Any]:
    """A spec's fields from JSON or a handler's answer, with lists back as the tuples they were."""
    return {k: tuple(v) if isinstance(v, list) else v for k, v in data.items()}


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m distopt.ps.server CONFIG_JSON", file=sys.stderr)
        return 2
    try:
        serve(json.loads(args[0]))
    except (ConfigError, RemoteCallError) as err:
        print(f"distopt.ps.server: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    # Run the handlers from the importable module, not ``__main__``: clients pickle them by
    # their qualified name ``distopt.ps.server.ps_server_*``, and the state must live there.
    from distopt.ps.server import main as _main

    sys.exit(_main())
