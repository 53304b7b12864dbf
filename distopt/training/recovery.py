"""A ``distopt.train`` job on Ray server actors going on after Ray restarted one of them
(``ps.backend: ray`` with ``ps.max_restarts > 0``).

When a server actor dies, the trainer's wait fails with a one-line
:class:`~distopt.errors.RemoteCallError` naming the actor (:func:`lost_server` recognizes it), and
Ray restarts the actor, which then refuses data calls until :func:`distopt.ps.recover` reloads
every server from one checkpoint (:mod:`distopt.ps.cluster.ray_recovery`). The trainers go back to that
checkpoint together: every trainer leaves its training loop with :class:`Rollback`, re-enters
:func:`distopt.training.trainer.train`, which finds the newest complete checkpoint exactly as a resumed
run does, calls :func:`recover_servers` (every trainer runs :func:`distopt.ps.recover`, which also
forgets that trainer's failed calls, then they meet at a barrier), restores the dense model,
optimizer, scheduler, RNG and data position, and trains on. With no checkpoint yet, every server
goes back to its seeded tables and the loop to step 0.

**Agreement.** The failure must be collective: if one trainer left its step while another entered
DDP's gradient all-reduce, their collectives would no longer match and both would hang until the
gloo timeout. So a lost server's error is *deferred* where it is raised (:meth:`Agreement.deferred`)
and every trainer learns of it at the next *agreement point*, a 1-element all-reduce of a "failed"
flag over the trainers' group (:meth:`Agreement.settle`); when any flag is set every trainer raises
:class:`Rollback`. The points are placed before any collective that a failed trainer would skip:

- after each micro-batch's forward (the fetches' waits, a pipeline's prefetched ones included),
  before its backward;
- in ``deterministic`` jobs, the barriers between the trainers' turns to push become the flag's
  all-reduce (no extra collective); asynchronous pushes fail at a later wait: the next fetch of
  their table (forward) or, since a restarted actor refuses saves, the servers' checkpoint save;
- after an evaluation, and in a checkpoint cut after the servers' save (before the checkpoint can
  be complete: a failed save never becomes a checkpoint).

Any other error fails its trainer as before, and the others fail at their next collective (the
one-line "left the trainers' process group" error): never a hang. Cost: one all-reduce of one
integer per micro-batch, only in jobs that can recover (``ray``, ``max_restarts > 0``, more than
one trainer).

Bounded: at most ``ps.max_restarts`` recoveries per trainer process (:data:`FOREVER` for ``-1``),
then the job fails with the one-line error. Each recovery is one log line on every trainer, and
the trainers' QPS logs list them in their footer (``recoveries``); the steps re-run after a
recovery replace the ones logged after its checkpoint (:func:`distopt.training.telemetry.reopen_log`).
"""

from __future__ import annotations

import contextlib
import logging
import re
from collections.abc import Callable, Iterator
from typing import Any, ParamSpec, TypeVar

import torch
import torch.distributed as dist

import distopt.ps as ps
from distopt.errors import DistoptError, RemoteCallError
from distopt.ps.cluster.session import backend_for
from distopt.ps.spec import ServerOptions
from distopt.ps.transport.base import ACTOR_EXITED, ACTOR_UNAVAILABLE
from distopt.training import state as job_state
from distopt.training.checkpoint import Checkpoint

logger = logging.getLogger(__name__)

P = ParamSpec("P")
T = TypeVar("T")

FOREVER = 100
"""Recoveries allowed with ``ps.max_restarts: -1`` (Ray restarts forever; the job does not)."""

_LOST = re.compile(
    rf" on (?P<server>ps\d+) failed: (?:{re.escape(ACTOR_EXITED)}|{re.escape(ACTOR_UNAVAILABLE)}|ServerRestarted: )"
)


def lost_server(err: BaseException) -> str | None:
    """The server actor (``ps0`` ..) whose process died or was restarted by Ray, when that is what
    ``err`` says; ``None`` for any other error (a timeout, a server-side exception, a bad call).

    The transport names the actor and Ray's reason (:func:`distopt.ps.transport.ray.ray_message`);
    a later call of a table whose push failed quotes that failure, so a search finds it too.
    """
    if not isinstance(err, RemoteCallError):
        return None
    found = _LOST.search(str(err))
    return found["server"] if found else None


class Rollback(DistoptError):
    """Every trainer leaves the step: a server actor was lost, the job goes back to a checkpoint."""

    def __init__(self, *, step: int, reasons: tuple[str | None, ...]) -> None:
        self.step = step
        self.reasons = reasons
        """Each trainer's error (by rank), ``None`` for those that saw none."""
        rank, reason = next((r, text) for r, text in enumerate(reasons) if text is not None)
        self.server = lost_server(RemoteCallError(reason)) or "a server"
        self.cause = f"trainer {rank}: {reason}"
        super().__init__(f"{self.server} lost at step {step} ({self.cause})")


def _world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


class Agreement:
    """Where a job's trainers agree to roll back (see the module); disabled: errors pass through
    and :meth:`barrier` is a plain barrier."""

    def __init__(self, *, enabled: bool, limit: int = 0) -> None:
        self.enabled = enabled
        self.limit = limit
        """How many recoveries :func:`retrying` allows."""
        self.step = 0
        """The loop's current step (named by a :class:`Rollback`)."""
        self.rollback: Rollback | None = None
        """Set between a rollback and the recovery that answers it."""
        self.history: list[dict[str, Any]] = []
        """The recoveries done, as the QPS logs' footers list them."""
        self._failure: RemoteCallError | None = None

    @classmethod
    def for_job(cls, options: ServerOptions) -> Agreement:
        """Enabled when the job's servers come back after a failure (``ps.backend: ray`` with
        ``ps.max_restarts`` other than 0)."""
        enabled = backend_for(options).can_recover(options)
        limit = FOREVER if options.max_restarts < 0 else options.max_restarts
        return cls(enabled=enabled, limit=limit)

    @contextlib.contextmanager
    def deferred(self) -> Iterator[None]:
        """Keep a lost server's error for the next :meth:`settle` (other errors raise at once)."""
        try:
            yield
        except RemoteCallError as err:
            if not self.enabled or lost_server(err) is None:
                raise
            self._failure = self._failure or err

    @contextlib.contextmanager
    def agreed(self) -> Iterator[None]:
        """The block's lost-server error, then an agreement point."""
        with self.deferred():
            yield
        self.settle()

    def deferring(self, fn: Callable[P, None]) -> Callable[P, None]:
        """``fn`` with its lost-server error deferred."""

        def run(*args: P.args, **kwargs: P.kwargs) -> None:
            with self.deferred():
                fn(*args, **kwargs)

        return run

    def barrier(self) -> None:
        """A barrier that is also an agreement point when enabled."""
        if self.enabled:
            self.settle()
        else:
            job_state.barrier()

    def settle(self) -> None:
        """Agreement point: :class:`Rollback` on every trainer when any deferred an error."""
        if not self.enabled:
            return
        failure, self._failure = self._failure, None
        mine = None if failure is None else str(failure)
        if _world() == 1:
            reasons: list[str | None] = [mine]
        else:
            flag = torch.tensor([0 if failure is None else 1], dtype=torch.int32)
            dist.all_reduce(flag)  # the only collective of a step that went well
            if not int(flag.item()):
                return
            reasons = [None] * _world()
            dist.all_gather_object(reasons, mine)
        if any(reason is not None for reason in reasons):
            raise Rollback(step=self.step, reasons=tuple(reasons))


def retrying(run: Callable[[], T], agreement: Agreement) -> T:
    """``run()`` (a training loop) again after each :class:`Rollback`, at most
    ``agreement.limit`` times; then the one-line :class:`RemoteCallError`."""
    while True:
        try:
            return run()
        except Rollback as rollback:
            done = len(agreement.history)
            if done >= agreement.limit:
                raise RemoteCallError(
                    f"{rollback}: no recovery left ({done} done, ps.max_restarts={agreement.limit})"
                ) from None
            agreement.rollback = rollback


def recover_servers(agreement: Agreement, found: Checkpoint | None) -> None:
    """Every trainer, re-entering the loop after ``agreement.rollback``: every server back at
    checkpoint ``found`` (``None``: the seeded tables), this trainer's failed calls forgotten."""
    rollback = agreement.rollback
    assert rollback is not None
    directory = str(found.path.resolve()) if found is not None else None
    recovery = ps.recover(directory)  # idempotent: every trainer runs it for its own client
    if recovery.checkpoint != directory:  # None reloads the job's record: it names no checkpoint
        raise RemoteCallError(
            f"recovery: the servers reloaded {recovery.checkpoint}, yet no complete "
            "checkpoint of the trainers exists"
        )
    job_state.barrier()  # no trainer calls a server before every one is reloaded
    agreement.rollback = None
    agreement.history.append(
        {
            "server": rollback.server,
            "failed_step": rollback.step,
            "resumed_from": found.step if found is not None else 0,
            "checkpoint": directory,
            "cause": rollback.cause,
        }
    )
    where = (
        f"checkpoint {directory} (step {found.step})"
        if found is not None
        else "the seeded tables (step 0)"
    )
    logger.warning(
        "recovery %d of %d: %s lost at step %d; every trainer and server back at %s (%s)",
        len(agreement.history),
        agreement.limit,
        rollback.server,
        rollback.step,
        where,
        rollback.cause,
    )
