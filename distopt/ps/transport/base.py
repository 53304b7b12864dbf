"""What a trainer's client needs from a transport: send one operation to one server, get a future.

Two implement it: :class:`~distopt.ps.transport.rpc.RpcTransport` (``torch.distributed.rpc``,
TensorPipe) and :class:`~distopt.ps.transport.ray.RayTransport` (Ray actor calls). Both accept the
names of :data:`~distopt.ps.server.parameter_server.OPERATIONS` they offer, complete the future on
a thread that may start more calls, and fail it (never raise) with a one-line
:class:`~distopt.errors.RemoteCallError` that names the operation and the server.
"""

from __future__ import annotations

from typing import Any, Protocol

from torch.futures import Future

ACTOR_EXITED = "the actor process exited or was killed"
ACTOR_UNAVAILABLE = "the actor is unreachable or restarting"
"""How the Ray transport says, in a call's ``<why>``, that a server actor died or is being
restarted (:func:`~distopt.ps.transport.ray.ray_message`). A job that can recover looks for them
(:func:`distopt.training.recovery.lost_server`) without importing Ray, which only Ray jobs load."""


class Transport(Protocol):
    """How requests reach the job's servers (the job's ``ps.backend``)."""

    def call(
        self, server: str, op: str, args: tuple[Any, ...], *, what: str, timeout_s: float
    ) -> Future:
        """Operation ``op`` with ``args`` on ``server``; the future of its answer.

        A failure, a timeout after ``timeout_s`` included, completes the future with a
        :class:`~distopt.errors.RemoteCallError` reading ``"<what> on <server> failed: <why>"``.
        """
        ...

    def close(self) -> None:
        """Stop sending; calls still pending fail (the trainer is leaving the job)."""
        ...
