"""Starting, joining and leaving a parameter-server job.

One job has two kinds of process in ONE RPC group: trainers ``trainer0..trainer{T-1}`` (ranks
``0..T-1``) and servers ``ps0..ps{S-1}`` (ranks ``T..T+S-1``)::

    with distopt.ps.running_servers(tables, ServerOptions(num_servers=2), num_trainers=2) as job:
        # in each trainer process (job is plain picklable data: pass it to spawned trainers)
        distopt.ps.init_trainer(job, rank=r, ddp=True)   # RPC group + gloo group of trainers
        model = DDP(dense_model)                         # dense params all-reduced over gloo
        ...; distopt.ps.push_gradients(lr=0.1)           # sparse rows pushed over RPC
        distopt.ps.shutdown()

Every member meets through ``job.plan`` (:mod:`distopt.rendezvous`). Here the launching process
hosts both stores, the RPC group's and the trainers' gloo group's, on free ports of
``ServerOptions.host``, so it must outlive the job; ``distopt.train`` jobs make the same calls with
a plan in which ``ps0`` hosts them (:mod:`distopt.job.ps_roles`). Every listener binds to
``ServerOptions.host``/``interface`` (loopback by default).

A job ends the same way whoever launched it:

- a trainer's :func:`shutdown` drains its pushes, tells every server it is done, leaves the RPC
  group and marks itself left in the RPC store; a trainer that fails once the group has formed
  calls :func:`abort` instead, which asks every server to exit with status 1;
- a server exits with status 0 once every trainer has told it so, with 1 on an abort or when a
  trainer falls silent for ``ServerOptions.trainer_timeout_s`` (``distopt.ps.server``);
- the store host closes the stores last: the launcher in :func:`stop_servers`, which also reaps the
  servers (killing by PID whatever has not exited in time, also on errors via
  :func:`running_servers`); ``ps0`` once every trainer has left (``distopt.job.ps_roles``).
"""

from __future__ import annotations

import contextlib
import dataclasses
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

import torch.distributed.rpc as rpc

from distopt import rendezvous
from distopt.errors import RemoteCallError
from distopt.ps import client
from distopt.ps.client import Route
from distopt.ps.server import (
    lists_as_tuples,
    ps_server_abort,
    ps_server_heartbeat,
    ps_server_tables,
    ps_server_trainer_done,
)
from distopt.ps.spec import ServerOptions, TableSpec, check_tables, server_name, trainer_name
from distopt.rendezvous import StorePlan

LAUNCHER = "launcher"
"""``StorePlan.hosted_by`` of jobs started here: the launching process, outside the RPC group."""
_ABORT_TIMEOUT_S = 5.0


@dataclasses.dataclass(kw_only=True, slots=True, frozen=True)
class PSJob:
    """Where a job's members meet: all a trainer needs to join (plain, picklable data)."""

    plan: StorePlan
    """The job's rendezvous stores and who hosts them (see :mod:`distopt.rendezvous`)."""
    num_trainers: int
    options: ServerOptions
    pids: tuple[int, ...] = ()
    """Server process ids when started by :func:`start_servers` on this machine."""
    logs: tuple[str, ...] = ()
    """Server log files (stdout + stderr), same order as ``pids``."""
    ray_address: str | None = None
    """``ps.backend: ray``: the Ray cluster holding the server actors (see :mod:`distopt.ps.ray_server`)."""
    ray_namespace: str | None = None
    """``ps.backend: ray``: the Ray namespace of this job's actors ``ps0 ..``."""

    @property
    def num_servers(self) -> int:
        return self.options.num_servers

    @property
    def world_size(self) -> int:
        return self.options.num_servers + self.num_trainers

    @property
    def servers(self) -> list[str]:
        return [server_name(i) for i in range(self.num_servers)]


@dataclasses.dataclass(kw_only=True, slots=True, frozen=True)
class _Membership:
    """The job this process joined as a trainer, and under which name."""

    job: PSJob
    name: str
    transport: Any = None
    """The :class:`~distopt.ps.ray_transport.RayTransport` of a ``ray`` job (closed on leaving)."""


_PROCESSES: dict[int, subprocess.Popen[bytes]] = {}
_HOSTED: dict[StorePlan, rendezvous.HostedStores] = {}  # stores this process hosts, by plan
_JOINED: list[_Membership] = []
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
    """Host the job's stores here, spawn ``options.num_servers`` server processes; returns at once.

    Servers finish starting when the trainers join (:func:`init_trainer`).
    """
    options = options or ServerOptions()
    tables = tuple(tables)
    check_tables(tables, options.num_servers)
    if num_trainers < 1:
        raise RemoteCallError(f"start_servers: num_trainers must be >= 1, got {num_trainers}")
    if options.backend == "ray":
        from distopt.ps import ray_server

        return ray_server.start_job(tables, options, num_trainers=num_trainers)
    logs_dir = Path(log_dir) if log_dir is not None else Path(tempfile.mkdtemp(prefix="distopt-ps-"))
    logs_dir.mkdir(parents=True, exist_ok=True)
    wanted = StorePlan(host=options.host, hosted_by=LAUNCHER, rpc_port=0, gloo_port=0)
    hosted = rendezvous.host_stores(wanted, me=LAUNCHER, timeout_s=options.join_timeout_s)
    world_size = options.num_servers + num_trainers
    pids, logs = [], []
    try:
        for index in range(options.num_servers):
            config = {
                "index": index,
                "rank": num_trainers + index,
                "world_size": world_size,
                "plan": dataclasses.asdict(hosted.plan),
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
        hosted.close()
        raise
    _HOSTED[hosted.plan] = hosted
    return PSJob(
        plan=hosted.plan, num_trainers=num_trainers, options=options, pids=tuple(pids), logs=tuple(logs)
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
    unreachable, or within about twice that if the servers do not join. A process keeps one RPC
    rank for life (torch's distributed-autograd container), so it may join later jobs with the same
    rank. With ``ddp=True`` also joins the trainers' gloo process group (the default group, so
    ``DistributedDataParallel`` uses it). A failure once the RPC group has formed aborts the servers.
    """
    options = job.options
    if not 0 <= rank < job.num_trainers:
        raise RemoteCallError(f"init_trainer: rank must be in 0..{job.num_trainers - 1}, got {rank}")
    name = trainer_name(rank)
    timeout_s = options.start_timeout_s
    if options.backend == "ray":
        from distopt.ps import ray_server

        ray_server.join(job, name, rank=rank, ddp=ddp)
        return
    try:
        rendezvous.meet(job.plan, me=name, others=job.servers, timeout_s=timeout_s)
        rendezvous.init_rpc(
            job.plan, name=name, rank=rank, world_size=job.world_size, transport=options,
            timeout_s=timeout_s,
        )  # fmt: skip
    except RemoteCallError as err:
        raise RemoteCallError(f"{err}{_log_tail(job)}") from None
    _JOINED.append(_Membership(job=job, name=name))
    try:
        answers = [rpc.rpc_async(s, ps_server_tables, timeout=timeout_s) for s in job.servers]
        client.connect(routes_from(job, [a.wait() for a in answers]), rpc_timeout_s=options.rpc_timeout_s)
        _start_heartbeat(name, job.servers, options.trainer_timeout_s)
        if ddp:
            rendezvous.init_gloo(
                job.plan, me=name, rank=rank, world_size=job.num_trainers, timeout_s=timeout_s
            )
    except BaseException as err:
        abort(f"{name} failed to start: {type(err).__name__}: {err}")
        raise


def routes_from(job: PSJob, answers: list[list[dict[str, Any]]]) -> dict[str, Route]:
    """Routes from every server's table specs (its ``tables()`` answer); a table's servers follow
    its placement order."""
    specs: dict[str, TableSpec] = {}
    for answer in answers:
        for data in answer:
            spec = TableSpec(**lists_as_tuples(data))
            specs[spec.name] = spec
    return {
        name: Route(spec, tuple(server_name(i) for i in spec.placement(job.num_servers)))
        for name, spec in specs.items()
    }


def shutdown(*, graceful: bool = True) -> None:
    """Leave the job: wait for pending pushes, tell each server we are done, leave both groups,
    then tell the store host we have left.

    A server exits once every trainer has told it so. ``graceful=False`` (after a server died)
    skips the flush and the goodbyes; :func:`stop_servers` (or :func:`abort`) ends the servers.
    """
    membership = _JOINED.pop() if _JOINED else None
    if membership is not None and membership.transport is not None:
        from distopt.ps import ray_server

        ray_server.leave(membership.transport, graceful=graceful)
        return
    _stop_heartbeat(wait=graceful)
    try:
        if graceful and client._CLIENT is not None and membership is not None:
            client.flush()
            timeout_s = membership.job.options.rpc_timeout_s
            byes = [rpc.rpc_async(s, ps_server_trainer_done, args=(membership.name,), timeout=timeout_s)
                    for s in client._CLIENT.servers]  # fmt: skip
            for bye in byes:
                with contextlib.suppress(RuntimeError):
                    bye.wait()
    finally:
        client.disconnect()
        rendezvous.leave_gloo()
        rendezvous.leave_rpc(me=membership.name if membership else "trainer", graceful=graceful)
    if graceful and membership is not None:
        job = membership.job
        rendezvous.leave(job.plan, me=membership.name, timeout_s=job.options.start_timeout_s)


def abort(reason: str) -> None:
    """Leave the job after a failure, asking every server to exit with status 1 (best effort).

    Without it the servers wait for the failed trainer until ``trainer_timeout_s`` (or until the
    launcher kills them), and the job and its other trainers fail only then.
    """
    membership = _JOINED[-1] if _JOINED else None
    if membership is not None and rpc.api._is_current_rpc_agent_set():
        timeout_s = min(_ABORT_TIMEOUT_S, membership.job.options.rpc_timeout_s)
        asks = []
        for server in membership.job.servers:
            with contextlib.suppress(RuntimeError):  # the agent is already shutting down
                asks.append(rpc.rpc_async(server, ps_server_abort, args=(reason,), timeout=timeout_s))
        for ask in asks:
            with contextlib.suppress(RuntimeError):  # that server is already gone
                ask.wait()
    shutdown(graceful=False)


def _kill(pids: Sequence[int]) -> None:
    for pid in pids:
        proc = _PROCESSES.pop(pid, None)
        if proc is None or proc.poll() is not None:
            continue
        os.kill(pid, signal.SIGKILL)
        proc.wait()


def stop_servers(job: PSJob, *, timeout_s: float = 10.0) -> list[int | None]:
    """Wait up to ``timeout_s`` for the servers to exit, kill the rest by PID, close the job's
    stores; the servers' exit codes."""
    deadline = time.monotonic() + timeout_s
    codes: list[int | None] = []
    if job.ray_namespace is not None:  # actors have no exit codes: None each
        from distopt.ps import ray_server

        ray_server.stop_job(job)
        codes = [None] * job.num_servers
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
    hosted = _HOSTED.pop(job.plan, None)
    if hosted is not None:
        hosted.close()
    return codes


@contextlib.contextmanager
def running_servers(
    tables: Sequence[TableSpec], options: ServerOptions | None = None, *, num_trainers: int = 1,
    stop_timeout_s: float = 10.0,
) -> Iterator[PSJob]:
    """:func:`start_servers`, yield the job, and always :func:`stop_servers` (killing by PID if needed)."""
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
    with running_servers(tables, options, num_trainers=1) as job:
        init_trainer(job, rank=0)
        try:
            yield job
        except BaseException as err:
            abort(f"{trainer_name(0)} failed: {type(err).__name__}: {err}")
            raise
        shutdown()
