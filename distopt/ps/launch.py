"""Starting, joining and stopping a parameter-server job.

One job has two kinds of process in ONE RPC group: trainers ``trainer0..trainer{T-1}`` (ranks
``0..T-1``) and servers ``ps0..ps{S-1}`` (ranks ``T..T+S-1``)::

    with distopt.ps.ps_job(tables, ServerOptions(num_servers=2), num_trainers=2) as job:
        # in each trainer process (job is plain picklable data: pass it to spawned trainers)
        distopt.ps.init_trainer(job, rank=r, ddp=True)   # RPC group + gloo group of trainers
        model = DDP(dense_model)                         # dense params all-reduced over gloo
        ...; distopt.ps.push_gradients(lr=0.1)           # sparse rows pushed over RPC
        distopt.ps.shutdown()

Two groups, two ports: the RPC group (servers + trainers) rendezvous at ``job.port`` (a store
hosted by the launching process, which must outlive the job); the gloo group (trainers only, for DDP) at ``job.ddp_port`` (a store hosted by
trainer 0). Both stores and all RPC/gloo listeners bind to ``ServerOptions.host`` (loopback by
default). Servers serve until every trainer has called :func:`shutdown`; :func:`stop_servers`
then reaps them, killing by PID whatever has not exited in time (also on errors, via the context
managers).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.distributed.rpc as rpc

from distopt import rendezvous
from distopt.errors import RemoteCallError
from distopt.ps import client
from distopt.ps.client import Route
from distopt.ps.server import ps_server_heartbeat, ps_server_tables, ps_server_trainer_done
from distopt.ps.spec import ServerOptions, TableSpec, check_tables, server_name, trainer_name


@dataclasses.dataclass(kw_only=True, slots=True, frozen=True)
class PSJob:
    """Where a job's RPC group meets: all a trainer needs to join (plain, picklable data)."""

    host: str
    port: int
    """Port of the RPC group's rendezvous store (hosted by ps0)."""
    num_trainers: int
    options: ServerOptions
    ddp_port: int | None = None
    """Port of the trainers' gloo-group store (hosted by trainer 0), if DDP is used."""
    pids: tuple[int, ...] = ()
    """Server process ids when started by :func:`start_servers` on this machine."""
    logs: tuple[str, ...] = ()
    """Server log files (stdout + stderr), same order as ``pids``."""

    @property
    def num_servers(self) -> int:
        return self.options.num_servers

    @property
    def world_size(self) -> int:
        return self.options.num_servers + self.num_trainers


_PROCESSES: dict[int, subprocess.Popen[bytes]] = {}
_STORES: dict[int, dist.TCPStore] = {}  # rendezvous stores hosted here, by port
_SHUTDOWN_TIMEOUT_S = [30.0]  # rpc_timeout_s of the job this process joined
_HEARTBEAT: list[tuple[threading.Event, threading.Thread, list[Any]]] = []


def _start_heartbeat(name: str, servers: Sequence[str], timeout_s: float) -> None:
    """Tell every server ``name`` is alive every ``timeout_s / 5`` until :func:`shutdown`.

    Servers exit when a trainer stays silent for ``ServerOptions.trainer_timeout_s`` (see
    ``distopt.ps.server.watch_trainers``). A failed heartbeat is ignored: the training calls to
    that server report the failure with its name.
    """
    stop = threading.Event()
    in_flight: list[Any] = []

    def beat() -> None:
        while True:
            sent = []
            for server in servers:
                try:
                    sent.append(
                        rpc.rpc_async(server, ps_server_heartbeat, args=(name,), timeout=timeout_s)
                    )
                except RuntimeError:
                    pass  # the agent is shutting down
            in_flight[:] = sent
            if stop.wait(timeout_s / 5):
                return

    thread = threading.Thread(target=beat, name="distopt-ps-heartbeat", daemon=True)
    _HEARTBEAT.append((stop, thread, in_flight))
    thread.start()


def _stop_heartbeat(*, wait: bool) -> None:
    """Stop the heartbeat thread; with ``wait``, let its last heartbeats complete (an RPC still
    in flight when the agent shuts down would hold the shutdown for its whole timeout)."""
    while _HEARTBEAT:
        stop, thread, in_flight = _HEARTBEAT.pop()
        stop.set()
        thread.join()
        for fut in in_flight if wait else ():
            with contextlib.suppress(Exception):
                fut.wait()


def start_servers(
    tables: Sequence[TableSpec],
    options: ServerOptions | None = None,
    *,
    num_trainers: int = 1,
    log_dir: str | Path | None = None,
) -> PSJob:
    """Spawn ``options.num_servers`` server processes on free loopback ports; returns at once.

    Servers finish starting when the trainers join (:func:`init_trainer`).
    """
    options = options or ServerOptions()
    tables = tuple(tables)
    check_tables(tables, options.num_servers)
    if num_trainers < 1:
        raise RemoteCallError(f"start_servers: num_trainers must be >= 1, got {num_trainers}")
    logs_dir = Path(log_dir) if log_dir is not None else Path(tempfile.mkdtemp(prefix="distopt-ps-"))
    logs_dir.mkdir(parents=True, exist_ok=True)
    store = rendezvous.host_store(options.host, 0, options.join_timeout_s)
    port = int(store.port)
    world_size = options.num_servers + num_trainers
    pids, logs = [], []
    try:
        for index in range(options.num_servers):
            config = {
                "index": index,
                "rank": num_trainers + index,
                "world_size": world_size,
                "port": port,
                "launcher_pid": os.getpid(),
                "options": dataclasses.asdict(options),
                "tables": [dataclasses.asdict(t) for t in tables],
            }
            log_path = logs_dir / f"{server_name(index)}.log"
            with open(log_path, "wb") as log:
                proc = subprocess.Popen(
                    [sys.executable, "-m", "distopt.ps.server", json.dumps(config)],
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,  # a Ctrl-C of the launcher is handled by the launcher
                )
            _PROCESSES[proc.pid] = proc
            pids.append(proc.pid)
            logs.append(str(log_path))
    except BaseException:
        _kill(pids)
        raise
    _STORES[port] = store
    return PSJob(
        host=options.host,
        port=port,
        num_trainers=num_trainers,
        options=options,
        ddp_port=rendezvous.free_port(options.host),
        pids=tuple(pids),
        logs=tuple(logs),
    )


def _log_tail(job: PSJob, limit: int = 3) -> str:
    """The last lines of the logs of servers that already exited (why a job failed to form)."""
    notes = []
    for pid, log in zip(job.pids, job.logs, strict=True):
        proc = _PROCESSES.get(pid)
        if proc is not None and proc.poll() is not None:
            lines = [ln for ln in Path(log).read_text(errors="replace").splitlines() if ln.strip()]
            tail = " | ".join(lines[-limit:]) or "no output"
            notes.append(f"server pid {pid} exited with {proc.returncode}: {tail}")
    return ("; " + "; ".join(notes)) if notes else ""


def init_trainer(job: PSJob, *, rank: int = 0, ddp: bool = False) -> None:
    """Join ``job`` as trainer ``rank`` (RPC name ``trainer{rank}``) and set up the PS client.

    Raises :class:`RemoteCallError` within ``options.start_timeout_s`` if the job's store is
    unreachable, or within about twice that if the servers do not join. A process keeps one RPC rank
    for life (torch's distributed-autograd container), so it may join later jobs with the same rank. With ``ddp=True`` also joins
    the trainers' gloo process group (the default group, so ``DistributedDataParallel`` uses it).
    """
    options = job.options
    if not 0 <= rank < job.num_trainers:
        raise RemoteCallError(f"init_trainer: rank must be in 0..{job.num_trainers - 1}, got {rank}")
    rendezvous.set_interface_env(options)
    name = trainer_name(rank)
    try:
        rendezvous.meet(
            job.host, job.port, me=name, timeout_s=options.start_timeout_s,
            others=[server_name(i) for i in range(job.num_servers)],
        )
    except RemoteCallError as err:
        raise RemoteCallError(f"{err}{_log_tail(job)}") from None
    try:
        rendezvous.init_rpc(
            name=name,
            rank=rank,
            world_size=job.world_size,
            port=job.port,
            options=options,
            timeout_s=options.start_timeout_s,
        )
    except Exception as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        servers = ", ".join(server_name(i) for i in range(job.num_servers))
        raise RemoteCallError(
            f"{name}: RPC group ({servers} + {job.num_trainers} trainers) did not form within "
            f"{options.start_timeout_s:g} s: {first}{_log_tail(job)}"
        ) from None
    _SHUTDOWN_TIMEOUT_S[0] = options.rpc_timeout_s
    try:
        client.connect(_discover_routes(job), rpc_timeout_s=options.rpc_timeout_s)
        _start_heartbeat(name, [server_name(i) for i in range(job.num_servers)],
                         options.trainer_timeout_s)
        if ddp:
            _init_ddp_group(job, rank)
    except BaseException:
        _stop_heartbeat(wait=False)
        rpc.shutdown(graceful=False)
        raise


def _discover_routes(job: PSJob) -> dict[str, Route]:
    """Ask every server which tables it holds; a table's servers follow its placement order."""
    servers = [server_name(i) for i in range(job.num_servers)]
    answers = [rpc.rpc_async(s, ps_server_tables, timeout=job.options.start_timeout_s) for s in servers]
    specs: dict[str, TableSpec] = {}
    for answer in answers:
        for data in answer.wait():
            data = {k: tuple(v) if isinstance(v, list) else v for k, v in data.items()}
            specs[data["name"]] = TableSpec(**data)
    return {
        name: Route(spec, tuple(server_name(i) for i in spec.placement(job.num_servers)))
        for name, spec in specs.items()
    }


def _init_ddp_group(job: PSJob, rank: int) -> None:
    if job.ddp_port is None:
        raise RemoteCallError("init_trainer(ddp=True): the job has no ddp_port")
    timeout = datetime.timedelta(seconds=job.options.start_timeout_s)
    if rank == 0:
        store = rendezvous.host_store(job.host, job.ddp_port, job.options.start_timeout_s)
    else:
        store = rendezvous.connect_store(job.host, job.ddp_port, job.options.start_timeout_s,
                                         what="trainer0's gloo store")
    dist.init_process_group("gloo", store=store, rank=rank, world_size=job.num_trainers, timeout=timeout)


def shutdown(*, graceful: bool = True) -> None:
    """Leave the job: wait for pending pushes, tell each server we are done, leave both groups.

    A server exits once every trainer has told it so. ``graceful=False`` (after a server died)
    skips the flush and the goodbyes; :func:`stop_servers` then kills what is left.
    """
    _stop_heartbeat(wait=graceful)
    try:
        if graceful and client._CLIENT is not None:
            client.flush()
            byes = [rpc.rpc_async(s, ps_server_trainer_done, args=(rpc.get_worker_info().name,),
                                  timeout=_SHUTDOWN_TIMEOUT_S[0]) for s in client._CLIENT.servers]
            for bye in byes:
                with contextlib.suppress(RuntimeError):
                    bye.wait()
    finally:
        client.disconnect()
        if dist.is_initialized():
            dist.destroy_process_group()
        if rpc.api._is_current_rpc_agent_set():
            # Never the graceful store barrier: see distopt.ps.server.serve.
            rpc.shutdown(graceful=False)


def _kill(pids: Sequence[int]) -> None:
    for pid in pids:
        proc = _PROCESSES.pop(pid, None)
        if proc is None or proc.poll() is not None:
            continue
        os.kill(pid, signal.SIGKILL)
        proc.wait()


def stop_servers(job: PSJob, *, timeout_s: float = 10.0) -> list[int | None]:
    """Wait up to ``timeout_s`` for the servers to exit, then kill the rest by PID; exit codes."""
    deadline = time.monotonic() + timeout_s
    codes: list[int | None] = []
    for pid in job.pids:
        proc = _PROCESSES.get(pid)
        if proc is None:
            codes.append(None)
            continue
        try:
            codes.append(proc.wait(timeout=max(0.0, deadline - time.monotonic())))
            _PROCESSES.pop(pid, None)
        except subprocess.TimeoutExpired:
            _kill([pid])
            codes.append(None)
    _STORES.pop(job.port, None)
    return codes


@contextlib.contextmanager
def ps_job(
    tables: Sequence[TableSpec], options: ServerOptions | None = None, *, num_trainers: int = 1,
    stop_timeout_s: float = 10.0,
) -> Iterator[PSJob]:
    """Start servers, yield the job, and always reap them (killing by PID if needed)."""
    job = start_servers(tables, options, num_trainers=num_trainers)
    failed = False
    try:
        yield job
    except BaseException:
        failed = True
        raise
    finally:
        stop_servers(job, timeout_s=1.0 if failed else stop_timeout_s)


@contextlib.contextmanager
def local_job(tables: Sequence[TableSpec], options: ServerOptions | None = None) -> Iterator[PSJob]:
    """Servers in subprocesses, this process as the only trainer; cleaned up however it exits."""
    with ps_job(tables, options, num_trainers=1) as job:
        init_trainer(job, rank=0)
        ok = False
        try:
            yield job
            ok = True
        finally:
            shutdown(graceful=ok)
