"""Parameter servers as Ray actors (``ps.backend: ray``): :class:`RayBackend`.

The same shards, updates and checkpoint files as the RPC server processes, reached through Ray:
server ``i`` is the actor ``ps{i}`` (:class:`~distopt.ps.transport.ray_actor.PSServerActor`) in a
namespace of the job's own, in one placement group (:mod:`distopt.ps.cluster.ray_placement`),
owned by the process that created it. Faults, restarts and why per-table order never relies on
Ray: ``docs/ps_runtime.md`` ("Ray jobs").

This module, and the Ray-only modules it imports, import Ray (optional: ``distopt[ray]``) at their
top; :data:`distopt.ps.cluster.session.BACKENDS` imports this one when a job picks ``ps.backend:
ray``, so that ``import distopt`` and RPC jobs do not import Ray.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import uuid
from typing import Any, ClassVar

import ray

from distopt.dist import rendezvous
from distopt.dist.rendezvous import StorePlan
from distopt.errors import RemoteCallError
from distopt.ps.cluster import ray_placement, ray_recovery
from distopt.ps.cluster.job import LAUNCHER, PSJob
from distopt.ps.cluster.lifecycle import Backend, Membership, Recovery, Servers, connect_client
from distopt.ps.server.shard_files import record_path
from distopt.ps.spec import ServerOptions, TableSpec, server_name
from distopt.ps.transport.ray import RayTransport, ray_message
from distopt.ps.transport.ray_actor import PSServerActor


def ensure_ray(address: str, options: ServerOptions) -> bool:
    """Connect this process to Ray at ``address`` unless it already is; whether it connected now.

    ``local`` starts a private instance bound to ``options.host`` with no dashboard.
    """
    if ray.is_initialized():
        return False
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # loopback-only head, nothing to guard
    if address == "local":
        if rendezvous.is_loopback(options.host):
            ray_placement.single_host()  # else Ray puts its node on this host's external address
        # Ray lowers its workers' priority (niceness 15), where the RPC backend's servers run at the
        # trainer's: on a busy host the trainer would then wait on starved server actors.
        ray.init(
            address="local",
            num_cpus=max(1, os.cpu_count() or 1),
            include_dashboard=False,
            _node_ip_address=options.host,
            log_to_driver=False,
            # Ray's own INFO line per start ("Started a local Ray instance.") on the job's stderr:
            # a successful run is quiet; warnings still show.
            logging_level=logging.WARNING,
            _system_config={"worker_niceness": 0},
        )
    else:
        ray_placement.connect(address, timeout_s=options.start_timeout_s)
    return True


@dataclasses.dataclass(slots=True)
class ServerActors:
    """Actors created here, held: Ray destroys an actor once no handle refers to it."""

    handles: list[Any]
    started_ray: bool
    """Whether this process started Ray for them (and stops it with them)."""
    group: Any
    """Their placement group (:func:`distopt.ps.cluster.ray_placement.reserve`)."""

    def exit_notes(self) -> str:
        return ""  # an actor that failed to start says so when a trainer looks it up


def lookup_actors(address: str, namespace: str, options: ServerOptions) -> dict[str, Any]:
    """Handles of the job's actors by server name, once each answers (within ``start_timeout_s``)."""
    ensure_ray(address, options)
    handles: dict[str, Any] = {}
    for name in (server_name(i) for i in range(options.num_servers)):
        try:
            handles[name] = ray.get_actor(name, namespace=namespace)
        except ValueError:
            raise RemoteCallError(
                f"ps.backend=ray: no actor {name!r} in namespace {namespace!r} of the Ray cluster "
                f"at {address}"
            ) from None
    pings = {name: h.stats.remote() for name, h in handles.items()}
    ready, _ = ray.wait(
        list(pings.values()), num_returns=len(pings), timeout=options.start_timeout_s
    )
    late = [name for name, ref in pings.items() if ref not in ready]
    if late:
        raise RemoteCallError(
            f"ps.backend=ray: actors {', '.join(late)} did not start within "
            f"{options.start_timeout_s:g} s (ps.start_timeout_s): each is a new process that "
            "imports torch, slow on a loaded host; raise ps.start_timeout_s (e.g. --set "
            f"ps.start_timeout_s={2 * options.start_timeout_s:g})"
        )
    for name, ref in pings.items():
        try:
            ray.get(ref)
        except Exception as err:
            raise RemoteCallError(
                f"ps.backend=ray: actor {name} failed to start: {ray_message(err)}"
            ) from None
    return handles


class RayBackend(Backend):
    """Server actors on a Ray cluster (see the module)."""

    name: ClassVar[str] = "ray"
    runs_server_processes: ClassVar[bool] = False

    def stores(self, options: ServerOptions) -> StorePlan:
        """Only the trainers' gloo store: trainers of a Ray job form no RPC group."""
        return StorePlan(host=options.host, hosted_by=LAUNCHER, rpc_port=None, gloo_port=0)

    def start(
        self,
        tables: tuple[TableSpec, ...],
        options: ServerOptions,
        *,
        plan: StorePlan,
        num_trainers: int,
        log_dir: str | None,
    ) -> tuple[PSJob, ServerActors]:
        """Create the job's server actors in a namespace of their own; returns at once (the
        trainers' lookups wait for the actors). Their logs are Ray's (``log_dir`` is unused)."""
        started_ray = ensure_ray(options.ray_address, options)
        namespace = f"{options.ray_namespace}-{uuid.uuid4().hex[:8]}"
        record = record_path(options, namespace)
        record.parent.mkdir(parents=True, exist_ok=True)
        group = ray_placement.reserve(options)
        actor_cls = ray.remote(PSServerActor)
        handles = [
            actor_cls.options(  # type: ignore[attr-defined]
                name=server_name(index),
                namespace=namespace,
                max_concurrency=options.num_worker_threads,
                max_restarts=options.max_restarts,
                **ray_placement.placed(options, group, index),
            ).remote(index, tables, options, str(record))
            for index in range(options.num_servers)
        ]
        job = PSJob(
            plan=plan,
            num_trainers=num_trainers,
            options=options,
            ray_address=ray.get_runtime_context().gcs_address,
            ray_namespace=namespace,
        )
        return job, ServerActors(handles, started_ray, group)

    def join(self, job: PSJob, *, name: str, rank: int, ddp: bool) -> Membership:
        """Find the actors and route the client through them."""
        if job.ray_address is None or job.ray_namespace is None:
            raise RemoteCallError(
                f"{name}: ps.backend=ray but the job names no Ray cluster (start it with "
                "distopt.ps.start_servers)"
            )
        options = job.options
        transport = RayTransport(lookup_actors(job.ray_address, job.ray_namespace, options))
        try:
            client = connect_client(job, transport, timeout_s=options.start_timeout_s)
            if ddp:
                rendezvous.init_gloo(
                    job.plan,
                    me=name,
                    rank=rank,
                    world_size=job.num_trainers,
                    timeout_s=options.start_timeout_s,
                )
        except BaseException:
            transport.close()
            raise
        return Membership(job=job, name=name, backend=self, transport=transport, client=client)

    def leave(self, membership: Membership, *, graceful: bool) -> None:
        """Drain this trainer's calls (if ``graceful``), stop the transport, leave gloo."""
        try:
            if graceful and membership.client is not None:
                membership.client.flush()
        finally:
            membership.transport.close()
            rendezvous.leave_gloo()

    def stop(self, job: PSJob, servers: Servers | None, *, timeout_s: float) -> list[int | None]:
        """Kill the actors (no restart) and remove their placement group; stop Ray if it was
        started for them. Actors have no exit codes: ``None`` each."""
        if isinstance(servers, ServerActors) and ray.is_initialized():
            for handle in servers.handles:
                with contextlib.suppress(ray.exceptions.RayActorError):  # already gone
                    ray.kill(handle, no_restart=True)
            assert job.ray_namespace is not None
            record_path(job.options, job.ray_namespace).unlink(missing_ok=True)
            ray_placement.release(servers.group)
            if servers.started_ray:
                ray.shutdown()
        return [None] * job.num_servers

    def can_recover(self, options: ServerOptions) -> bool:
        """With ``ps.max_restarts`` other than 0."""
        return options.max_restarts != 0

    def recover(self, membership: Membership, directory: str | None) -> Recovery:
        return ray_recovery.recover(membership, directory)

    def servers_ready(self, membership: Membership, timeout_s: float) -> bool:
        return ray_recovery.servers_ready(membership, timeout_s)

    def recording(
        self, membership: Membership, directory: str
    ) -> contextlib.AbstractContextManager[None]:
        return ray_recovery.recording(membership.job, directory)
