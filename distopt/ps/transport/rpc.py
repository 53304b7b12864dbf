"""The RPC transport (``ps.backend: rpc``): ``torch.distributed.rpc`` over TensorPipe, both ends.

Server end: one handler per operation a server offers on RPC, ``ps_server_<name>``, made here from
:data:`~distopt.ps.server.parameter_server.OPERATIONS` and bound as this module's globals: torch
pickles a function by its module and qualified name, so the server process finds the same
function by importing this module. Each handler answers with the process's served
:class:`~distopt.ps.server.parameter_server.ParameterServer` (:func:`served`). Handlers of read
operations are declared with :func:`distopt.remote.register_read`, so a user's raw
``rpc_sync("ps0", HANDLERS["fetch"], ...)`` is scheduled as a read.

Trainer end: :class:`RpcTransport` sends ``rpc_async(server, HANDLERS[op], args)`` and turns any
failure into a :class:`RemoteCallError` naming the server and the server's one-line message.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import torch.distributed.rpc as rpc
from torch.futures import Future

from distopt.errors import RemoteCallError
from distopt.ps.server.operation import Operation
from distopt.ps.server.parameter_server import OPERATIONS, ParameterServer
from distopt.remote import register_read

_SERVED: ParameterServer | None = None


def serve_here(server: ParameterServer | None) -> None:
    """Make ``server`` the one this process's handlers answer with (``None``: none)."""
    global _SERVED
    _SERVED = server


def served() -> ParameterServer:
    """The parameter server this process serves over RPC.

    Process-wide because torch RPC runs a handler as a plain module-level function, with only the
    arguments the trainer sent: a handler cannot be handed its server, so it looks it up here. One
    RPC process serves one server (:mod:`distopt.ps.cluster.rpc_process` sets it).
    """
    if _SERVED is None:
        raise RuntimeError("this process is not a distopt parameter server")
    return _SERVED


def _handler(op: Operation) -> Callable[..., Any]:
    def handler(*args: Any) -> Any:
        return served().answer(op, args)

    handler.__name__ = handler.__qualname__ = f"ps_server_{op.name}"
    handler.__module__ = __name__
    handler.__doc__ = op.method.__doc__
    if op.read:
        register_read(handler)
    return handler


HANDLERS: dict[str, Callable[..., Any]] = {
    name: _handler(op) for name, op in OPERATIONS.items() if "rpc" in op.transports
}
"""Operation name → its RPC handler ``ps_server_<name>``."""
globals().update((handler.__name__, handler) for handler in HANDLERS.values())


_WORKER_LINE = re.compile(r"On WorkerInfo\(id=\d+, name=[^)]*\):(?:\\n|\n)(.*?)(?:\\n|\n)")
_EXC_REPR = re.compile(r"^([\w.]+)\((['\"])(.*)\2\)$")
_TIMED_OUT = "ran for more than set timeout"
_CONNECTION_LOST = ("eof", "pipe closed", "connection reset", "connection refused", "broken pipe")


def remote_message(err: BaseException) -> str:
    """The server-side exception as one line (``KeyError: ...``), without RPC framing/traceback.

    torch re-raises a handler's exception as ``<Type>: On WorkerInfo(id=.., name=..):`` followed by
    a line with the exception's ``repr`` and the remote traceback (all escaped once more for
    ``KeyError``); the ``repr`` line is the message.
    """
    text = str(err)
    match = _WORKER_LINE.search(text)
    if match:
        line = match.group(1).replace("\\'", "'").replace('\\"', '"')
        exc = _EXC_REPR.match(line)
        return f"{exc.group(1)}: {exc.group(3)}" if exc else line
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return f"{type(err).__name__}: {lines[0]}" if lines else type(err).__name__


def failure_message(err: BaseException, *, timeout_s: float) -> str:
    """:func:`remote_message`, with what a timeout or a lost connection means for the job."""
    message = remote_message(err)
    if _TIMED_OUT in message:
        return (
            f"no answer within {timeout_s:g} s (ps.rpc_timeout_s): the server is slow, "
            "stuck or gone"
        )
    if any(marker in message.lower() for marker in _CONNECTION_LOST):
        return f"connection lost, the server process exited or was killed ({message})"
    return message


class RpcTransport:
    """Calls to the job's server processes in this process's RPC group, by worker name."""

    def call(
        self, server: str, op: str, args: tuple[Any, ...], *, what: str, timeout_s: float
    ) -> Future:
        """``rpc_async(server, HANDLERS[op], args)`` as a future failing with a
        :class:`RemoteCallError` that names ``server``."""
        out: Future = Future()
        handler = HANDLERS.get(op)
        try:
            if handler is None:
                raise RemoteCallError(f"{what} on {server} failed: {op!r} has no RPC handler")
            inner = rpc.rpc_async(server, handler, args=args, timeout=timeout_s)
        except (
            Exception
        ) as err:  # agent gone, unknown worker name: report at the wait like the rest
            if not isinstance(err, RemoteCallError):
                message = failure_message(err, timeout_s=timeout_s)
                err = RemoteCallError(f"{what} on {server} failed: {message}")
            out.set_exception(err)
            return out

        def done(fut: Future) -> None:
            try:
                out.set_result(fut.value())
            except Exception as err:
                message = failure_message(err, timeout_s=timeout_s)
                out.set_exception(RemoteCallError(f"{what} on {server} failed: {message}"))

        inner.add_done_callback(done)
        return out

    def close(self) -> None:
        """Nothing to stop: the RPC agent is the job's to shut down (the backend does)."""
