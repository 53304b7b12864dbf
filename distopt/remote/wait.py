"""The wait op the scheduling passes insert, bound to its remote call's spec when it is created.

Each :class:`~distopt.remote.registry.RemoteCallSpec` owns one wait op (``spec.wait_op``), made
here when the spec is registered. A rewritten graph calls it directly, so nothing is looked up by
name while training::

    fetch_issue = distopt_ps_client_calls_fetch_async('emb0', getitem)
    fetch_wait = distopt_remote_wait_wait_fetch(fetch_issue, 'model.py:12: rows = ps.fetch(...)')

The op runs the spec's ``wait`` inside a ``record_function("distopt.wait:<name>")`` range, so waits
show in profiles (unless that ``wait`` opens a range of its own, as ``distopt.ps.wait`` does: a
second one cost each wait a few microseconds the hand-written model does not pay), and turns a
failure into a :class:`~distopt.errors.RemoteCallError` quoting the server's message and the
user's source line.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable
from typing import Any

import torch.fx
from torch.autograd.profiler import record_function
from torch.fx import Node

from distopt.errors import RemoteCallError
from distopt.where import call_site

WaitOp = Callable[..., Any]


def server_message(err: BaseException) -> str:
    """One line of a remote error: RPC prefixes ``On WorkerInfo(...):`` and appends a traceback."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    if not lines:
        return type(err).__name__
    if lines[0].endswith(":") and len(lines) > 1:
        return f"{lines[0]} {lines[1]}"
    return lines[0]


def make_wait_op(call: str, wait: Callable[[Any], Any], *, profiled: bool = False) -> WaitOp:
    """The wait op of the remote call named ``call`` whose futures ``wait`` resolves.

    The op's arguments: the future an issue returned, the user's source line of the original
    blocking call (quoted in errors), and for a batched issue ``item``, the index of this call's
    result in the list the batched future resolves to. ``profiled``: ``wait`` opens its own
    profiler range, and the op opens none.
    """
    short = call.rsplit(".", 1)[-1]

    def wait_op(future: Any, where: str, item: int | None = None) -> Any:
        scope = contextlib.nullcontext() if profiled else record_function(f"distopt.wait:{short}")
        with scope:
            try:
                value = wait(future)
                return value if item is None else value[item]
            except Exception as err:
                if getattr(err, "where", None) is not None:
                    raise  # already names a source line
                error = RemoteCallError(
                    f"remote call {short} failed: {server_message(err)} (called at {where})"
                )
                error.server_message = str(err)  # type: ignore[attr-defined]
                error.where = where  # type: ignore[attr-defined]
                raise error from err

    wait_op.__name__ = wait_op.__qualname__ = "wait_" + re.sub(r"\W", "_", short)
    wait_op._distopt_wait_of = call  # type: ignore[attr-defined]
    # Dead-code elimination must keep a wait even when its value is unused (a push's wait).
    torch.fx.node.has_side_effect(wait_op)
    return wait_op


def is_wait(node: Node) -> bool:
    """Whether ``node`` calls a wait op."""
    return node.op == "call_function" and hasattr(node.target, "_distopt_wait_of")


def source_line(node: Node) -> str:
    """``file:line: code`` of the user's call that created ``node`` (see :func:`distopt.where.call_site`)."""
    return call_site(node.stack_trace or node.meta.get("stack_trace"), f"graph node {node.name}")
