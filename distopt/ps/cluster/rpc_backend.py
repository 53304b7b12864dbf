"""Parameter servers as processes in one ``torch.distributed.rpc`` group (``ps.backend: rpc``).

:class:`RpcBackend` spawns the server processes (:mod:`distopt.ps.cluster.rpc_main`), forms
one RPC group of trainers ``trainer0..`` (ranks ``0..T-1``) and servers ``ps0..`` (ranks
``T..T+S-1``), keeps each trainer's :class:`Heartbeat`, and ends the job. Who hosts the stores and
how a job ends, whoever launched it: ``docs/ps_runtime.md`` ("RPC jobs").
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
from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar

import torch.distributed.rpc as rpc

from distopt.dist import rendezvous
from distopt.dist.rendezvous import StorePlan
from distopt.errors import RemoteCallError
from distopt.ps.cluster import rpc_process
from distopt.ps.cluster.job import LAUNCHER, PSJob
from distopt.ps.cluster.lifecycle import (
    Backend,
    Membership,
    Servers,
    connect_client,
    leave_process_groups,
)
from distopt.ps.spec import ServerOptions, TableSpec, server_name
from distopt.ps.transport.rpc import RpcTransport

SERVER_COMMAND = "distopt.ps.cluster.rpc_main"
"""The module a server process runs (``python -m``); named, not imported, so that ``-m`` runs it
fresh (:mod:`distopt.ps.cluster.rpc_main`)."""

_ABORT_TIMEOUT_S = 5.0


@dataclasses.dataclass(slots=True)
class ServerProcesses:
    """The server processes a launcher spawned, by PID, with their log files."""

    processes: dict[int, subprocess.Popen[bytes]]
    logs: dict[int, str]

    def exit_notes(self, limit: int = 3) -> str:
        """The last lines of the logs of servers that already exited (why a job failed to form)."""
        notes = []
        for pid, proc in self.processes.items():
            if proc.poll() is not None:
                text = Path(self.logs[pid]).read_text(errors="replace")
                lines = [ln for ln in text.splitlines() if ln.strip()]
                tail = " | ".join(lines[-limit:]) or "no output"
                notes.append(f"server pid {pid} exited with {proc.returncode}: {tail}")
        return ("; " + "; ".join(notes)) if notes else ""

    def kill(self, pids: Sequence[int]) -> None:
        """SIGKILL those of ``pids`` still running, and reap them."""
        for pid in pids:
            proc = self.processes.pop(pid, None)
            if proc is None or proc.poll() is not None:
                continue
            os.kill(pid, signal.SIGKILL)
            proc.wait()


class Heartbeat:
    """Tells every server a trainer is alive every ``timeout_s / 5`` until :meth:`stop`.

    Servers exit when a trainer stays silent for ``ServerOptions.trainer_timeout_s``. A failed
    heartbeat is ignored: the training calls to that server report the failure with its name.
    """

    def __init__(
        self, name: str, servers: Sequence[str], transport: RpcTransport, timeout_s: float
    ) -> None:
        self._stop = threading.Event()
        self._in_flight: list[Any] = []

        def beat() -> None:
            while True:
                self._in_flight[:] = [
                    transport.call(
                        server, "heartbeat", (name,), what="heartbeat", timeout_s=timeout_s
                    )
                    for server in servers
                ]
                if self._stop.wait(timeout_s / 5):
                    return

        self._thread = threading.Thread(target=beat, name="distopt-ps-heartbeat", daemon=True)
        self._thread.start()

    def stop(self, *, wait: bool) -> None:
        """Stop beating; with ``wait``, let the last heartbeats complete (an RPC still in flight
        when the agent shuts down would hold the shutdown for its whole timeout)."""
        self._stop.set()
        self._thread.join()
        for fut in self._in_flight if wait else ():
            with contextlib.suppress(Exception):
                fut.wait()


class RpcBackend(Backend):
    """Server processes in the trainers' RPC group (see the module)."""

    name: ClassVar[str] = "rpc"
    runs_server_processes: ClassVar[bool] = True

    def stores(self, options: ServerOptions) -> StorePlan:
        return StorePlan(host=options.host, hosted_by=LAUNCHER, rpc_port=0, gloo_port=0)

    def start(
        self,
        tables: tuple[TableSpec, ...],
        options: ServerOptions,
        *,
        plan: StorePlan,
        num_trainers: int,
        log_dir: str | None,
    ) -> tuple[PSJob, ServerProcesses]:
        """Spawn ``options.num_servers`` ``python -m distopt.ps.cluster.rpc_main`` processes,
        each logging to ``<log_dir>/ps<i>.log`` (a new temporary directory by default)."""
        logs_dir = (
            Path(log_dir) if log_dir is not None else Path(tempfile.mkdtemp(prefix="distopt-ps-"))
        )
        logs_dir.mkdir(parents=True, exist_ok=True)
        servers = ServerProcesses(processes={}, logs={})
        try:
            for index in range(options.num_servers):
                config = rpc_process.config(
                    index=index,
                    num_trainers=num_trainers,
                    plan=plan,
                    options=options,
                    tables=tables,
                    launcher_pid=os.getpid(),
                )
                log_path = logs_dir / f"{server_name(index)}.log"
                with open(log_path, "wb") as log:
                    proc = subprocess.Popen(
                        [
                            *options.command_prefix,
                            sys.executable,
                            "-m",
                            SERVER_COMMAND,
                            json.dumps(config),
                        ],
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,  # a Ctrl-C of the launcher is the launcher's
                    )
                servers.processes[proc.pid] = proc
                servers.logs[proc.pid] = str(log_path)
        except BaseException:
            servers.kill(list(servers.processes))
            raise
        job = PSJob(
            plan=plan,
            num_trainers=num_trainers,
            options=options,
            pids=tuple(servers.processes),
            logs=tuple(servers.logs.values()),
        )
        return job, servers

    def join(self, job: PSJob, *, name: str, rank: int, ddp: bool) -> Membership:
        """Meet the servers, form the RPC group, learn the tables, start the heartbeat; raises
        :class:`RemoteCallError` within ``start_timeout_s`` if the job's store is unreachable, or
        within about twice that if the servers do not join."""
        options = job.options
        timeout_s = options.start_timeout_s
        rendezvous.meet(job.plan, me=name, others=job.servers, timeout_s=timeout_s)
        rendezvous.init_rpc(
            job.plan,
            name=name,
            rank=rank,
            world_size=job.world_size,
            transport=options,
            timeout_s=timeout_s,
        )
        transport = RpcTransport()
        membership = Membership(job=job, name=name, backend=self, transport=transport)
        try:
            membership.client = connect_client(job, transport, timeout_s=timeout_s)
            membership.heartbeat = Heartbeat(
                name, job.servers, transport, options.trainer_timeout_s
            )
            if ddp:
                rendezvous.init_gloo(
                    job.plan, me=name, rank=rank, world_size=job.num_trainers, timeout_s=timeout_s
                )
        except BaseException as err:
            self.abort(membership, f"{name} failed to start: {type(err).__name__}: {err}")
            raise
        return membership

    def leave(self, membership: Membership, *, graceful: bool) -> None:
        """Drain, tell each server this trainer is done, leave both groups, then tell the store
        host this trainer has left. ``graceful=False`` (a server died) skips the drain and the
        goodbyes: ``stop`` (or an abort) ends the servers."""
        if membership.heartbeat is not None:
            membership.heartbeat.stop(wait=graceful)
        client = membership.client
        try:
            if graceful and client is not None:
                client.flush()
                timeout_s = membership.job.options.rpc_timeout_s
                byes = [
                    membership.transport.call(
                        server,
                        "trainer_done",
                        (membership.name,),
                        what="goodbye",
                        timeout_s=timeout_s,
                    )
                    for server in client.servers
                ]
                for bye in byes:
                    with contextlib.suppress(RemoteCallError):
                        bye.wait()
        finally:
            leave_process_groups(membership.name, graceful=graceful)
        if graceful:
            job = membership.job
            rendezvous.leave(job.plan, me=membership.name, timeout_s=job.options.start_timeout_s)

    def abort(self, membership: Membership, reason: str) -> None:
        """Ask every server to exit with status 1 (best effort), then leave.

        Without it the servers wait for the failed trainer until ``trainer_timeout_s`` (or until
        the launcher kills them), and the job and its other trainers fail only then.
        """
        if rpc.api._is_current_rpc_agent_set():
            timeout_s = min(_ABORT_TIMEOUT_S, membership.job.options.rpc_timeout_s)
            asks = [
                membership.transport.call(
                    server, "abort", (reason,), what="abort", timeout_s=timeout_s
                )
                for server in membership.job.servers
            ]
            for ask in asks:
                with contextlib.suppress(RemoteCallError):  # that server is already gone
                    ask.wait()
        self.leave(membership, graceful=False)

    def stop(self, job: PSJob, servers: Servers | None, *, timeout_s: float) -> list[int | None]:
        """Wait up to ``timeout_s`` for the servers to exit, kill the rest by PID; exit codes."""
        deadline = time.monotonic() + timeout_s
        processes = servers.processes if isinstance(servers, ServerProcesses) else {}
        codes: list[int | None] = []
        for pid in job.pids:
            proc = processes.get(pid)
            if proc is None:
                codes.append(None)
                continue
            try:
                codes.append(proc.wait(timeout=max(0.0, deadline - time.monotonic())))
                processes.pop(pid, None)
            except subprocess.TimeoutExpired:
                assert isinstance(servers, ServerProcesses)
                servers.kill([pid])
                codes.append(None)
        return codes
