"""Parameter servers as Ray actors (``ps.backend: ray``): the same shards, updates and checkpoint
files as the RPC server processes, reached through Ray instead of TensorPipe.

Server ``i`` is the actor named ``ps{i}`` in the job's Ray namespace (``ServerOptions.ray_namespace``
plus a per-job suffix, so consecutive jobs never meet a dying actor's name). Each actor wraps one
:class:`distopt.ps.server._ServerState`, the object the RPC handlers delegate to: fetch, push,
checkpoints, stats and latency injection are one code path on both backends, and a checkpoint
written on one backend loads on the other.

Actors are created by the launcher (:func:`distopt.ps.start_servers`; in a ``distopt.train`` job,
trainer 0: :mod:`distopt.job.ray_roles`) in one placement group (:mod:`distopt.ps.ray_cluster`),
owned by it (they die with it: never an orphan), and killed by :func:`distopt.ps.stop_servers`.

Faults. Calls in flight on an actor whose process dies fail at the trainer's wait with a one-line
:class:`~distopt.errors.RemoteCallError` naming the table and the actor, within
``ps.rpc_timeout_s``. Ray restarts a dead actor ``ps.max_restarts`` times (0: never; later calls
keep failing). A restarted actor's constructor reloads its shards from the job's last checkpoint,
named by a record file whose path is a constructor argument (the seeded tables if the job saved
none; a log line says which), then refuses fetches, pushes and saves with ``ServerRestarted`` until
:func:`distopt.ps.recover` reloads every server from that checkpoint: the recipe, and why a record
file, are in :mod:`distopt.ps.ray_recovery`.

Ordering. An actor runs ``max_concurrency = num_worker_threads`` calls at once (fetches of a slow
server overlap, like the RPC thread pool), and a threaded Ray actor does **not** execute calls in
submission order. Per-table ordering therefore never relies on Ray: the client sends a table's push
only after the answers to that table's previous push and to every fetch issued before it have
arrived, and a fetch only after the previous push's answer (:mod:`distopt.ps.ordering`). So at any
moment the calls of one trainer that are in flight on an actor for one table are fetches only, which
commute; calls for different tables touch different shards, each guarded by its own lock. (A
pipeline's stale mode lets pushes overtake on purpose; the same holds on RPC.) Calls
that address the whole server (state_dict, save, load, set_latency) are sent after
:func:`distopt.ps.flush`. Across trainers there is no order, as with RPC.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
import uuid
from collections.abc import Sequence
from typing import Any

import torch

from distopt import rendezvous
from distopt.errors import ConfigError, RemoteCallError
from distopt.ps import client, launch, ray_cluster, ray_recovery
from distopt.ps.launch import LAUNCHER, PSJob
from distopt.ps.ray_transport import RayTransport, ray_message
from distopt.ps.ray_wire import from_wire, to_wire
from distopt.ps.server import _ServerState, ps_server_tables
from distopt.ps.spec import ServerOptions, TableSpec, server_name
from distopt.rendezvous import StorePlan


class ServerRestarted(RuntimeError):
    """A restarted server actor refuses fetches, pushes and saves until :func:`distopt.ps.recover`."""


class PSServerActor:
    """One parameter server: its shards and sparse optimizer state (wrapped by ``ray.remote``).

    Methods mirror the RPC handlers ``distopt.ps.server.ps_server_*`` and delegate to the same
    :class:`~distopt.ps.server._ServerState` methods. ``record`` is the job's checkpoint record
    (:mod:`distopt.ps.ray_recovery`): a restarted actor reloads the checkpoint it names.
    """

    def __init__(self, index: int, tables: tuple[TableSpec, ...], options: ServerOptions,
                 record: str | None = None) -> None:  # fmt: skip
        import ray

        # Handlers are small index_select/index_add calls: one intra-op thread each avoids
        # oversubscribing the cores that trainers and other servers share (as the RPC server).
        torch.set_num_threads(1)
        self.spec = (index, tables, options)
        self.state = _ServerState(index, tables, options)
        self.note = ""
        """Set when Ray restarted this actor: what it reloaded (it refuses data calls meanwhile)."""
        if ray.get_runtime_context().was_current_actor_reconstructed:
            self.note = self._reload_after_restart(record)
            print(f"distopt.ps.ray_server: {self.note}", file=sys.stderr, flush=True)

    def _reload_after_restart(self, record: str | None) -> str:
        head = f"{self.state.name} was restarted by Ray (pid {os.getpid()})"
        seeded = "it starts from the seeded initial tables"
        try:
            directory = ray_recovery.read_record(record) if record else None
        except ConfigError as err:
            return f"{head}; {err}: {seeded}"
        if directory is None:
            return f"{head}; no checkpoint saved by this job yet: {seeded}"
        try:
            self.state.load(directory)
        except Exception as err:  # any failure: a constructor that raises would end the actor for good
            self.state = _ServerState(*self.spec)  # never a half-loaded shard
            return f"{head}; cannot reload {directory} ({type(err).__name__}: {err}): {seeded}"
        return f"{head} and reloaded its shards from {directory}"

    def _usable(self) -> None:
        if self.note:
            raise ServerRestarted(f"{self.note}; call distopt.ps.recover() to reload every server")

    # Tensors cross as NumPy arrays both ways (distopt.ps.ray_wire).
    def fetch(self, table: str, ids: Any) -> Any:
        self._usable()
        return to_wire(self.state.fetch(table, from_wire(ids)))

    def fetch_many(self, requests: list[tuple[str, Any]]) -> list[Any]:
        self._usable()
        return to_wire(self.state.fetch_many(from_wire(requests)))

    def push(self, table: str, ids: Any, grads: Any, lr: float) -> None:
        self._usable()
        self.state.push(table, from_wire(ids), from_wire(grads), lr)

    def push_many(self, pushes: list[tuple[str, Any, Any]], lr: float) -> None:
        self._usable()
        self.state.push_many(from_wire(pushes), lr)

    def state_dict(self) -> dict[str, dict[str, Any]]:
        return to_wire(self.state.state_dict())

    def load_state_dict(self, state: dict[str, dict[str, Any]]) -> None:
        self.state.load_state_dict(from_wire(state))
        self.note = ""

    def save(self, directory: str) -> tuple[str, int]:
        self._usable()  # a restarted shard next to later ones is no checkpoint
        return self.state.save(directory)

    def load(self, directory: str) -> None:
        self.state.load(directory)
        self.note = ""

    def restore(self, directory: str | None) -> str:
        """Reload the shards from checkpoint ``directory`` (``None``: the seeded initial tables)
        and answer calls again (:func:`distopt.ps.recover`); what was done, in words."""
        fresh = _ServerState(*self.spec)  # loaded aside: a failed load leaves nothing half-done
        fresh.latency_s, fresh.counts = self.state.latency_s, self.state.counts
        if directory is not None:
            fresh.load(directory)
        self.state, self.note = fresh, ""
        return directory or "seeded"

    def incarnation(self) -> dict[str, Any]:
        """This actor's process and, after a restart, what it reloaded (``fenced``: it refuses
        data calls until :meth:`restore`)."""
        return {"pid": os.getpid(), "fenced": bool(self.note), "note": self.note}

    def tables(self) -> list[dict[str, Any]]:
        return self.state.tables()

    def stats(self) -> dict[str, int]:
        return self.state.stats()

    def set_latency(self, latency_ms: float) -> float:
        return self.state.set_latency(latency_ms)


def ensure_ray(address: str, options: ServerOptions) -> bool:
    """Connect this process to Ray at ``address`` unless it already is; whether it connected now.

    ``local`` starts a private instance bound to ``options.host`` with no dashboard.
    """
    import ray

    if ray.is_initialized():
        return False
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # loopback-only head, nothing to guard
    if address == "local":
        if rendezvous.is_loopback(options.host):
            ray_cluster.single_host()  # else Ray puts its node on this host's external address
        # Ray lowers its workers' priority (niceness 15), where the RPC backend's servers run at the
        # trainer's: on a busy host the trainer would then wait on starved server actors.
        ray.init(address="local", num_cpus=max(1, os.cpu_count() or 1), include_dashboard=False,
                 _node_ip_address=options.host, log_to_driver=False,
                 _system_config={"worker_niceness": 0})  # fmt: skip
    else:
        ray_cluster.connect(address, timeout_s=options.start_timeout_s)
    return True


@dataclasses.dataclass(frozen=True, slots=True)
class _Started:
    """Actors created here (held: Ray destroys an actor once no handle refers to it)."""

    handles: list[Any]
    started_ray: bool
    """Whether this process started Ray for them (and stops it with them)."""
    group: Any
    """Their placement group (:func:`distopt.ps.ray_cluster.reserve`)."""


_STARTED: dict[str, _Started] = {}
"""Jobs started here, by namespace, until :func:`stop_job`."""


def start_actors(tables: Sequence[TableSpec], options: ServerOptions) -> tuple[str, str]:
    """Create the job's server actors; ``(ray address, namespace)``.

    Returns at once: the trainers' first calls (:func:`lookup_actors`) wait for the actors.
    """
    import ray

    started = ensure_ray(options.ray_address, options)
    namespace = f"{options.ray_namespace}-{uuid.uuid4().hex[:8]}"
    record = ray_recovery.record_path(options, namespace)
    record.parent.mkdir(parents=True, exist_ok=True)
    group = ray_cluster.reserve(options)
    actor_cls = ray.remote(PSServerActor)
    handles = [
        actor_cls.options(  # type: ignore[attr-defined]
            name=server_name(index), namespace=namespace, max_concurrency=options.num_worker_threads,
            max_restarts=options.max_restarts, **ray_cluster.placed(options, group, index),
        ).remote(index, tuple(tables), options, str(record))
        for index in range(options.num_servers)
    ]  # fmt: skip
    _STARTED[namespace] = _Started(handles, started, group)
    return ray.get_runtime_context().gcs_address, namespace


def lookup_actors(address: str, namespace: str, options: ServerOptions) -> dict[str, Any]:
    """Handles of the job's actors by server name, once each answers (within ``start_timeout_s``)."""
    import ray

    ensure_ray(address, options)
    names = [server_name(i) for i in range(options.num_servers)]
    handles: dict[str, Any] = {}
    for name in names:
        try:
            handles[name] = ray.get_actor(name, namespace=namespace)
        except ValueError:
            raise RemoteCallError(f"ps.backend=ray: no actor {name!r} in namespace {namespace!r} "
                                  f"of the Ray cluster at {address}") from None  # fmt: skip
    pings = {name: h.stats.remote() for name, h in handles.items()}
    ready, _ = ray.wait(list(pings.values()), num_returns=len(pings), timeout=options.start_timeout_s)
    late = [name for name, ref in pings.items() if ref not in ready]
    if late:
        raise RemoteCallError(f"ps.backend=ray: actors {', '.join(late)} did not start within "
                              f"{options.start_timeout_s:g} s (ps.start_timeout_s)")  # fmt: skip
    for name, ref in pings.items():
        try:
            ray.get(ref)
        except Exception as err:
            raise RemoteCallError(f"ps.backend=ray: actor {name} failed to start: {ray_message(err)}") from None
    return handles


# --- a job on actors: what distopt.ps.launch does for options.backend == "ray" --------------------

def start_job(tables: Sequence[TableSpec], options: ServerOptions, *, num_trainers: int) -> PSJob:
    """``start_servers``: the server actors, and only the trainers' gloo store here (trainers of a
    ``ray`` job form no RPC group)."""
    wanted = StorePlan(host=options.host, hosted_by=LAUNCHER, rpc_port=None, gloo_port=0)
    hosted = rendezvous.host_stores(wanted, me=LAUNCHER, timeout_s=options.join_timeout_s)
    try:
        address, namespace = start_actors(tables, options)
    except BaseException:
        hosted.close()
        raise
    launch._HOSTED[hosted.plan] = hosted
    return PSJob(plan=hosted.plan, num_trainers=num_trainers, options=options, ray_address=address,
                 ray_namespace=namespace)  # fmt: skip


def join(job: PSJob, name: str, *, rank: int, ddp: bool) -> None:
    """``init_trainer``: find the actors and route the client through them. No heartbeat: the
    actors belong to the launcher, which stops them (and they die with it)."""
    if job.ray_address is None or job.ray_namespace is None:
        raise RemoteCallError(f"{name}: ps.backend=ray but the job names no Ray cluster (start it "
                              "with distopt.ps.start_servers)")  # fmt: skip
    options = job.options
    transport = RayTransport(lookup_actors(job.ray_address, job.ray_namespace, options))
    try:
        answers = [transport.call(s, ps_server_tables, (), what="tables", timeout_s=options.start_timeout_s)
                   for s in job.servers]  # fmt: skip
        routes = launch.routes_from(job, [answer.wait() for answer in answers])
        client.connect(routes, rpc_timeout_s=options.rpc_timeout_s, call=transport.call,
                       servers=tuple(job.servers))  # fmt: skip
        if ddp:
            rendezvous.init_gloo(job.plan, me=name, rank=rank, world_size=job.num_trainers,
                                 timeout_s=options.start_timeout_s)  # fmt: skip
    except BaseException:
        client.disconnect()
        transport.close()
        raise
    launch._JOINED.append(launch._Membership(job=job, name=name, transport=transport))


def leave(transport: RayTransport, *, graceful: bool) -> None:
    """``shutdown``: drain this trainer's calls (if ``graceful``), stop the transport, leave gloo."""
    import torch.distributed as dist

    try:
        if graceful and client.is_connected():
            client.flush()
    finally:
        client.disconnect()
        transport.close()
        if dist.is_initialized():
            dist.destroy_process_group()


def stop_job(job: PSJob) -> None:
    """``stop_servers``: kill the actors (no restart); stop Ray if it was started for this job."""
    import ray

    assert job.ray_namespace is not None
    started = _STARTED.pop(job.ray_namespace, None)
    if started is None or not ray.is_initialized():
        return
    for handle in started.handles:
        with contextlib.suppress(ray.exceptions.RayActorError):  # already gone
            ray.kill(handle, no_restart=True)
    ray_recovery.record_path(job.options, job.ray_namespace).unlink(missing_ok=True)
    ray_cluster.release(started.group)
    if started.started_ray:
        ray.shutdown()
