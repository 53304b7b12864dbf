"""The Ray transport's server end: a parameter server as a Ray actor (``ps.backend: ray``).

:class:`PSServerActor` holds one :class:`~distopt.ps.server.parameter_server.ParameterServer`.
Its methods are made here, one per operation the server offers on Ray, from
:data:`~distopt.ps.server.parameter_server.OPERATIONS`: each turns the NumPy arrays it received
back into tensors (:mod:`distopt.ps.transport.ray_wire`), dispatches through
:meth:`ParameterServer.answer` and sends tensors back as arrays.

Restarts: when Ray runs the constructor again after the actor's process died
(``ps.max_restarts``), the actor reloads its shards from the job's last checkpoint, named by the
record file whose path is a constructor argument (the seeded tables if the job saved none; a log
line says which), and fences the server: fetches, pushes and saves are refused with
``ServerRestarted`` until :func:`distopt.ps.recover` reloads every server from that checkpoint
(the recipe, and why a record file: :mod:`distopt.ps.cluster.ray_recovery`).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import Any

import ray
import torch

from distopt.errors import ConfigError
from distopt.ps.server.operation import Operation
from distopt.ps.server.parameter_server import OPERATIONS, ParameterServer
from distopt.ps.server.shard_files import read_record
from distopt.ps.spec import ServerOptions, TableSpec
from distopt.ps.transport.ray_wire import from_wire, to_wire


class PSServerActor:
    """One parameter server (wrapped by ``ray.remote``); its methods are the server's operations.

    ``record`` is the job's checkpoint record: a restarted actor reloads the checkpoint it names.
    """

    def __init__(
        self,
        index: int,
        tables: tuple[TableSpec, ...],
        options: ServerOptions,
        record: str | None = None,
    ) -> None:
        # Handlers are small index_select/index_add calls: one intra-op thread each avoids
        # oversubscribing the cores that trainers and other servers share (as the RPC server).
        torch.set_num_threads(1)
        self.server = ParameterServer(index, tables, options)
        if ray.get_runtime_context().was_current_actor_reconstructed:
            self.server.fence = self._reload_after_restart(record)
            print(f"distopt.ps.ray_server: {self.server.fence}", file=sys.stderr, flush=True)

    def _reload_after_restart(self, record: str | None) -> str:
        """Reload the job's last checkpoint; what was done, in words (the server's fence)."""
        head = f"{self.server.name} was restarted by Ray (pid {os.getpid()})"
        seeded = "it starts from the seeded initial tables"
        try:
            directory = read_record(record) if record else None
        except ConfigError as err:
            return f"{head}; {err}: {seeded}"
        if directory is None:
            return f"{head}; no checkpoint saved by this job yet: {seeded}"
        try:
            self.server.restore(directory)  # loads aside: a failure leaves the seeded shards
        except Exception as err:  # any failure: a constructor that raises ends the actor for good
            return f"{head}; cannot reload {directory} ({type(err).__name__}: {err}): {seeded}"
        return f"{head} and reloaded its shards from {directory}"


def _method(op: Operation) -> Callable[..., Any]:
    def method(self: PSServerActor, *args: Any) -> Any:
        return to_wire(self.server.answer(op, from_wire(args)))

    method.__name__ = op.name
    method.__qualname__ = f"{PSServerActor.__qualname__}.{op.name}"
    method.__doc__ = op.method.__doc__
    return method


for _op in OPERATIONS.values():
    if "ray" in _op.transports:
        setattr(PSServerActor, _op.name, _method(_op))
