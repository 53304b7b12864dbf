"""Starting, joining, leaving and stopping a parameter-server job: this process's :class:`Session`.

A launcher starts the servers and hands the :class:`~distopt.ps.cluster.job.PSJob` (plain data) to
its trainers; each trainer joins it::

    with distopt.ps.running_servers(tables, ServerOptions(num_servers=2), num_trainers=2) as job:
        # in each trainer process (job is plain picklable data: pass it to spawned trainers)
        distopt.ps.init_trainer(job, rank=r, ddp=True)   # the servers + gloo group of trainers
        model = DDP(dense_model)                         # dense params all-reduced over gloo
        ...; distopt.ps.push_gradients(lr=0.1)           # sparse rows pushed to the servers
        distopt.ps.shutdown()

The module's functions are the public API (:func:`start_servers`, :func:`init_trainer`,
:func:`shutdown`, :func:`abort`, :func:`stop_servers`, :func:`recover`, ...); each asks this
process's session, which holds what the process launched (servers and the stores it hosts for
their job) and the job it joined (membership, transport, client), and hands the work to the job's
backend (:mod:`distopt.ps.cluster.lifecycle`: ``rpc`` or ``ray``). How each backend starts and ends
a job: :mod:`distopt.ps.cluster.rpc_backend`, :mod:`distopt.ps.cluster.ray_backend` (imported, and
Ray with it, only by a process whose job picks ``ps.backend: ray``: :data:`BACKENDS`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from distopt.dist import rendezvous
from distopt.dist.rendezvous import StorePlan
from distopt.errors import RemoteCallError, extra_missing
from distopt.ps.client import calls
from distopt.ps.client.cache import check_caches
from distopt.ps.cluster.job import LAUNCHER, PSJob
from distopt.ps.cluster.lifecycle import (
    Backend,
    Launched,
    Membership,
    Recovery,
    leave_process_groups,
    not_recoverable,
)
from distopt.ps.cluster.rpc_backend import RpcBackend
from distopt.ps.spec import ServerOptions, TableSpec, check_tables, trainer_name


def _ray_backend() -> Backend:
    # Ray is optional (distopt[ray]) and slow to import; the Ray backend imports it, so it is
    # loaded only when a job picks it (`import distopt` and RPC jobs never import Ray).
    try:
        from distopt.ps.cluster.ray_backend import RayBackend
    except ModuleNotFoundError as err:
        raise extra_missing(err, extra="ray", key="ps.backend: ray") from None
    return RayBackend()


BACKENDS: dict[str, Callable[[], Backend]] = {"rpc": RpcBackend, "ray": _ray_backend}
"""Every ``ps.backend`` by name (:data:`distopt.ps.spec.BACKENDS` lists the names), as a factory:
a backend's module is imported when a job picks it, as TorchX loads a scheduler by name."""


def backend_for(options: ServerOptions) -> Backend:
    """The backend of a job with ``options`` (``ps.backend``); backends hold no state."""
    return BACKENDS[options.backend]()


class Session:
    """This process's part in parameter-server jobs: the jobs it launched and the one it joined."""

    def __init__(self) -> None:
        self.launched: dict[StorePlan, Launched] = {}
        """Jobs started here, by their store plan, until :meth:`stop`."""
        self.membership: Membership | None = None
        """The job this process joined as a trainer, until :meth:`leave` or :meth:`abort`."""

    def start(
        self,
        tables: Sequence[TableSpec],
        options: ServerOptions | None = None,
        *,
        num_trainers: int = 1,
        log_dir: str | Path | None = None,
        plan: StorePlan | None = None,
    ) -> PSJob:
        """Start the servers of a job; with no ``plan``, host its stores here too."""
        options = options or ServerOptions()
        tables = tuple(tables)
        check_tables(tables, options.num_servers)
        check_caches(options.cache, tables)
        if num_trainers < 1:
            raise RemoteCallError(f"start_servers: num_trainers must be >= 1, got {num_trainers}")
        backend = backend_for(options)
        hosted = None
        if plan is None:
            wanted = backend.stores(options)
            hosted = rendezvous.host_stores(wanted, me=LAUNCHER, timeout_s=options.join_timeout_s)
            plan = hosted.plan
        try:
            job, servers = backend.start(
                tables,
                options,
                plan=plan,
                num_trainers=num_trainers,
                log_dir=None if log_dir is None else str(log_dir),
            )
        except BaseException:
            if hosted is not None:
                hosted.close()
            raise
        self.launched[job.plan] = Launched(job=job, servers=servers, hosted=hosted)
        return job

    def stop(self, job: PSJob, *, timeout_s: float = 10.0) -> list[int | None]:
        """End the servers this process started for ``job`` and close the stores it hosts."""
        launched = self.launched.pop(job.plan, None)
        try:
            servers = launched.servers if launched is not None else None
            return backend_for(job.options).stop(job, servers, timeout_s=timeout_s)
        finally:
            if launched is not None and launched.hosted is not None:
                launched.hosted.close()

    def join(self, job: PSJob, *, rank: int = 0, ddp: bool = False) -> None:
        """Join ``job`` as trainer ``rank``; its client serves this process's calls from now."""
        if not 0 <= rank < job.num_trainers:
            raise RemoteCallError(
                f"init_trainer: rank must be in 0..{job.num_trainers - 1}, got {rank}"
            )
        if self.membership is not None:
            joined = self.membership
            raise RemoteCallError(
                f"init_trainer: this process is {joined.name} of a job already; "
                "call distopt.ps.shutdown() first"
            )
        try:
            membership = backend_for(job.options).join(
                job, name=trainer_name(rank), rank=rank, ddp=ddp
            )
        except RemoteCallError as err:
            launched = self.launched.get(job.plan)
            notes = launched.servers.exit_notes() if launched is not None else ""
            if notes:
                raise RemoteCallError(f"{err}{notes}") from None
            raise
        self.membership = membership
        calls.connect(membership.client)

    def leave(self, *, graceful: bool = True) -> None:
        """Leave the job joined (see :func:`shutdown`)."""
        membership, self.membership = self.membership, None
        try:
            if membership is None:
                leave_process_groups()
            else:
                membership.backend.leave(membership, graceful=graceful)
        finally:
            calls.connect(None)

    def abort(self, reason: str) -> None:
        """Leave the job joined after a failure, asking the servers to fail it (:func:`abort`)."""
        membership, self.membership = self.membership, None
        try:
            if membership is None:
                leave_process_groups()
            else:
                membership.backend.abort(membership, reason)
        finally:
            calls.connect(None)

    def recover(self, directory: str | None = None) -> Recovery:
        """Every server of the job joined back at one checkpoint (:func:`recover`)."""
        if self.membership is None:
            raise not_recoverable("recover")
        return self.membership.backend.recover(self.membership, directory)

    def servers_ready(self, timeout_s: float = 5.0) -> bool:
        """Whether every server of the job joined answers (:func:`servers_ready`)."""
        if self.membership is None:
            raise not_recoverable("servers_ready")
        return self.membership.backend.servers_ready(self.membership, timeout_s)

    def recording(self, directory: str) -> contextlib.AbstractContextManager[None]:
        """Around a save into or a load from ``directory`` by every server of the job joined."""
        if self.membership is None:
            return contextlib.nullcontext()
        return self.membership.backend.recording(self.membership, directory)


_SESSION = Session()


def session() -> Session:
    """This process's session.

    Process-wide because the public API is plain functions (``distopt.ps.shutdown()``, as
    ``torch.distributed.destroy_process_group()``): a job joined in one call is left in another,
    and jobs started by :func:`start_servers` are stopped by :func:`stop_servers` given only the
    job's plain data.
    """
    return _SESSION


def start_servers(
    tables: Sequence[TableSpec],
    options: ServerOptions | None = None,
    *,
    num_trainers: int = 1,
    log_dir: str | Path | None = None,
) -> PSJob:
    """Host the job's stores here, start ``options.num_servers`` servers; returns at once.

    Servers finish starting when the trainers join (:func:`init_trainer`).
    """
    return session().start(tables, options, num_trainers=num_trainers, log_dir=log_dir)


def init_trainer(job: PSJob, *, rank: int = 0, ddp: bool = False) -> None:
    """Join ``job`` as trainer ``rank`` (named ``trainer{rank}``) and set up the PS client.

    Raises :class:`RemoteCallError` within ``options.start_timeout_s`` if the job's store is
    unreachable, or within about twice that if the servers do not join. A process keeps one RPC
    rank for life (torch's distributed-autograd container), so it may join later jobs with the same
    rank. With ``ddp=True`` also joins the trainers' gloo process group (the default group, so
    ``DistributedDataParallel`` uses it). A failure once the servers could hear of it aborts them.
    """
    session().join(job, rank=rank, ddp=ddp)


def shutdown(*, graceful: bool = True) -> None:
    """Leave the job: wait for pending pushes, tell each server we are done, leave the groups,
    then tell the store host we have left.

    A server exits once every trainer has told it so. ``graceful=False`` (after a server died)
    skips the flush and the goodbyes; :func:`stop_servers` (or :func:`abort`) ends the servers.
    """
    session().leave(graceful=graceful)


def abort(reason: str) -> None:
    """Leave the job after a failure, asking every server to exit with status 1 (best effort).

    Without it the servers wait for the failed trainer until ``trainer_timeout_s`` (or until the
    launcher kills them), and the job and its other trainers fail only then.
    """
    session().abort(reason)


def stop_servers(job: PSJob, *, timeout_s: float = 10.0) -> list[int | None]:
    """Wait up to ``timeout_s`` for the servers to exit, kill the rest by PID, close the job's
    stores; the servers' exit codes (``None`` for Ray actors, which have none)."""
    return session().stop(job, timeout_s=timeout_s)


def recover(directory: str | None = None) -> Recovery:
    """Bring every server of this trainer's ``ps.backend: ray`` job back to one checkpoint
    (:func:`distopt.ps.cluster.ray_recovery.recover`); a one-line error on other jobs."""
    return session().recover(directory)


def servers_ready(timeout_s: float = 5.0) -> bool:
    """Whether every server actor of this trainer's Ray job answers within ``timeout_s`` (a
    restarted one once its constructor has reloaded the checkpoint)."""
    return session().servers_ready(timeout_s)


@contextlib.contextmanager
def running_servers(
    tables: Sequence[TableSpec],
    options: ServerOptions | None = None,
    *,
    num_trainers: int = 1,
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
