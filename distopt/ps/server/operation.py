"""How a parameter server's operations are declared: once, as methods of the server.

A method of :class:`~distopt.ps.server.parameter_server.ParameterServer` marked with
:func:`operation` is something a trainer may ask a server to do. Everything else is derived from
that one declaration (:func:`operations`): the RPC handlers ``ps_server_<name>``
(:mod:`distopt.ps.transport.rpc`), the Ray actor's methods (:mod:`distopt.ps.transport.ray_actor`),
the names both transports accept, which handlers ``distopt.remote`` schedules as reads, and which
calls a server that Ray restarted refuses until :func:`distopt.ps.recover`. Adding an operation is
writing one method::

    @operation(read=True, fenced=True)
    def fetch(self, table: str, ids: torch.Tensor) -> torch.Tensor: ...
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])

TRANSPORTS: tuple[str, ...] = ("rpc", "ray")


@dataclasses.dataclass(frozen=True, slots=True)
class Operation:
    """One request a parameter server answers."""

    name: str
    """The method's name: ``ps_server_<name>`` on RPC, the actor method ``<name>`` on Ray."""
    method: Callable[..., Any]
    """The server's method (called with the server first)."""
    read: bool = False
    """Changes no server state: its RPC handler is declared a read to :mod:`distopt.remote`, so a
    user's raw ``rpc_sync("ps0", ps_server_fetch, ...)`` is scheduled as one."""
    fenced: bool = False
    """Touches the tables' rows (or writes them out): refused by a server Ray restarted until
    every server is reloaded from one checkpoint (:mod:`distopt.ps.cluster.ray_recovery`)."""
    unfences: bool = False
    """Replaces every shard: a restarted server answers fenced calls again once it succeeded."""
    transports: tuple[str, ...] = TRANSPORTS
    """The transports offering it (a server process's trainer bookkeeping is RPC's alone)."""

    @property
    def summary(self) -> str:
        """The first line of the method's docstring."""
        doc = (self.method.__doc__ or "").strip()
        return doc.splitlines()[0] if doc else ""


def operation(
    *,
    read: bool = False,
    fenced: bool = False,
    unfences: bool = False,
    transports: tuple[str, ...] = TRANSPORTS,
) -> Callable[[F], F]:
    """Mark a server method as an operation trainers may call (see the module)."""

    def mark(method: F) -> F:
        spec = Operation(
            name=method.__name__,
            method=method,
            read=read,
            fenced=fenced,
            unfences=unfences,
            transports=transports,
        )
        method.__ps_operation__ = spec  # type: ignore[attr-defined]
        return method

    return mark


def operations(cls: type) -> dict[str, Operation]:
    """The operations ``cls`` declares, by name, in the order they are defined."""
    found = (getattr(value, "__ps_operation__", None) for value in vars(cls).values())
    return {spec.name: spec for spec in found if isinstance(spec, Operation)}
