"""The life of a parameter-server job, one interface with an implementation per ``ps.backend``.

A :class:`Backend` says how a job's servers are started and stopped, how a trainer joins and
leaves them, and whether they can come back after a failure, as TorchX's ``Scheduler`` says how
an app is submitted and described, whatever the cluster::

    start  (launcher)  tables, options      -> PSJob + the servers it started (Launched)
    join   (trainer)   PSJob                -> Membership: transport + client
    leave  (trainer)   Membership           -> drained, goodbyes said, groups left
    abort  (trainer)   Membership, reason   -> the servers told to fail the job, groups left
    stop   (launcher)  PSJob, Launched      -> servers ended, exit codes
    recover(trainer)   Membership           -> every server back at one checkpoint

Two implement it: :class:`~distopt.ps.cluster.rpc_backend.RpcBackend` (server processes in one
``torch.distributed.rpc`` group) and :class:`~distopt.ps.cluster.ray_backend.RayBackend` (Ray actors).
Backends hold no state: what a process launched and joined is held by its
:class:`~distopt.ps.cluster.session.Session`, which picks the backend with :func:`backend_for`.
"""

from __future__ import annotations

import abc
import contextlib
import dataclasses
from collections.abc import Sequence
from typing import Any, ClassVar, Protocol

from distopt.dist import rendezvous
from distopt.dist.rendezvous import HostedStores, StorePlan
from distopt.errors import RemoteCallError
from distopt.ps.client.cache import build_caches
from distopt.ps.client.calls import Client, Route
from distopt.ps.cluster.job import PSJob
from distopt.ps.spec import ServerOptions, TableSpec, server_name
from distopt.ps.transport.base import Transport


class Beating(Protocol):
    """What a backend keeps running while a trainer is a member (RPC: its heartbeat)."""

    def stop(self, *, wait: bool) -> None: ...


class Servers(Protocol):
    """The servers a backend started in this process (processes, actors), until it stops them."""

    def exit_notes(self) -> str:
        """Why some already ended, for an error about a job that failed to form ("" if none)."""
        ...


@dataclasses.dataclass(slots=True)
class Launched:
    """A job this process started: its servers, and the stores it hosts for the job, if any."""

    job: PSJob
    servers: Servers
    hosted: HostedStores | None


@dataclasses.dataclass(slots=True)
class Membership:
    """The job this process joined as a trainer, under which name, and how it reaches the servers."""

    job: PSJob
    name: str
    backend: Backend
    transport: Transport
    client: Client | None = None
    """Set once the servers told which tables they hold."""
    heartbeat: Beating | None = None
    """What the backend runs while the trainer is a member (RPC: its heartbeat thread)."""


@dataclasses.dataclass(frozen=True, slots=True)
class Recovery:
    """What :func:`distopt.ps.recover` did."""

    checkpoint: str | None
    """The checkpoint every server now holds; ``None``: the seeded initial tables (step 0)."""
    restarted: tuple[str, ...]
    """Servers the cluster had restarted since they last recovered (``ps1``, ...)."""


class Backend(abc.ABC):
    """How a job's servers run and how trainers reach them (see the module)."""

    name: ClassVar[str]
    runs_server_processes: ClassVar[bool]
    """Whether the job has ``ps`` processes of its own (RPC) or none (Ray: trainer 0 creates them)."""

    @abc.abstractmethod
    def stores(self, options: ServerOptions) -> StorePlan:
        """The rendezvous stores a launcher hosts for a job (free ports: ``0``)."""

    @abc.abstractmethod
    def start(
        self,
        tables: tuple[TableSpec, ...],
        options: ServerOptions,
        *,
        plan: StorePlan,
        num_trainers: int,
        log_dir: str | None,
    ) -> tuple[PSJob, Servers]:
        """Start the servers of a job meeting at ``plan``; returns at once (the servers finish
        starting when the trainers join)."""

    @abc.abstractmethod
    def join(self, job: PSJob, *, name: str, rank: int, ddp: bool) -> Membership:
        """Join ``job`` as trainer ``name`` (and the trainers' gloo group with ``ddp``); a
        failure once the servers could hear of it aborts them."""

    @abc.abstractmethod
    def leave(self, membership: Membership, *, graceful: bool) -> None:
        """Leave the job: with ``graceful``, drain this trainer's calls and say goodbye first."""

    def abort(self, membership: Membership, reason: str) -> None:
        """Leave after a failure, asking the servers to fail the job where they can."""
        self.leave(membership, graceful=False)

    @abc.abstractmethod
    def stop(self, job: PSJob, servers: Servers | None, *, timeout_s: float) -> list[int | None]:
        """End the servers this process started for ``job`` (``None``: it started none); their
        exit codes (``None`` where there is none)."""

    def can_recover(self, options: ServerOptions) -> bool:
        """Whether a job's servers come back after one dies (and its trainers roll back)."""
        return False

    def recover(self, membership: Membership, directory: str | None) -> Recovery:
        """Every server back at checkpoint ``directory`` (see :func:`distopt.ps.recover`)."""
        raise not_recoverable("recover")

    def servers_ready(self, membership: Membership, timeout_s: float) -> bool:
        """Whether every server answers within ``timeout_s`` (see :func:`distopt.ps.servers_ready`)."""
        raise not_recoverable("servers_ready")

    def recording(
        self, membership: Membership, directory: str
    ) -> contextlib.AbstractContextManager[None]:
        """Around a save into or a load from ``directory`` by every server: what a restarted
        server must know of it (nothing here)."""
        return contextlib.nullcontext()


def not_recoverable(what: str) -> RemoteCallError:
    """The error of asking a job whose servers do not come back to recover them."""
    return RemoteCallError(
        f"distopt.ps.{what}: only a ps.backend=ray job's servers come back after a failure "
        "(RPC jobs restart whole: distopt.roles.supervise, docs/reliability.md)"
    )


def routes_from(job: PSJob, answers: Sequence[list[dict[str, Any]]]) -> dict[str, Route]:
    """Routes from every server's ``tables`` answer; a table's servers follow its placement."""
    specs: dict[str, TableSpec] = {}
    for answer in answers:
        for data in answer:
            spec = TableSpec.from_dict(data)
            specs[spec.name] = spec
    return {
        name: Route(spec, tuple(server_name(i) for i in spec.placement(job.num_servers)))
        for name, spec in specs.items()
    }


def connect_client(job: PSJob, transport: Transport, *, timeout_s: float) -> Client:
    """Ask every server of ``job`` which tables it holds; the client routing to them."""
    answers = [
        transport.call(server, "tables", (), what="tables", timeout_s=timeout_s)
        for server in job.servers
    ]
    routes = routes_from(job, [answer.wait() for answer in answers])
    held = {name: (route.spec, len(route.servers)) for name, route in routes.items()}
    return Client(
        routes,
        transport=transport,
        rpc_timeout_s=job.options.rpc_timeout_s,
        servers=job.servers,
        caches=build_caches(job.options.cache, held),
    )


def leave_process_groups(me: str = "trainer", *, graceful: bool = False) -> None:
    """Leave the trainers' gloo group and the RPC group, if this process is in them; with
    ``graceful``, the RPC group together with the other members (see :func:`rendezvous.leave_rpc`)."""
    rendezvous.leave_gloo()
    rendezvous.leave_rpc(me=me, graceful=graceful)
