"""The wait the scheduling passes insert: ``remote_wait(future, call, where)`` in generated code.

It runs inside a profiler range named after the call (so waits show in traces) and turns a
failure into a ``RemoteCallError`` that quotes the server's message and the user's source line.
"""

from __future__ import annotations

import re
from typing import Any

from torch.autograd.profiler import record_function
from torch.fx import Node

from distopt.errors import RemoteCallError
from distopt.passes.side_effects import mark_side_effectful
from distopt.remote import registry
from distopt.remote.registry import RemoteCallSpec


def _find_spec(call: str) -> RemoteCallSpec | None:
    # The most recent registration wins when two functions share a qualified name.
    found = None
    for spec in registry.registered_specs():
        if spec.name == call:
            found = spec
    return found


def _server_message(err: BaseException) -> str:
    """One line of the remote error: RPC prefixes ``On WorkerInfo(...):`` and appends a traceback."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    if not lines:
        return type(err).__name__
    if lines[0].endswith(":") and len(lines) > 1:
        return f"{lines[0]} {lines[1]}"
    return lines[0]


def remote_wait(future: Any, call: str, where: str, item: int | None = None) -> Any:
    """Wait for an issued remote call inside a profiler range; failures become RemoteCallError.

    Args:
        future: what the issue returned (a single call's future, or a batched call's future).
        call: qualified name of the blocking function (``RemoteCallSpec.name``); its registered
            ``wait`` turns the future into the value the blocking call returns.
        where: the user's source line of the original blocking call, quoted in errors.
        item: for a batched issue, which result this wait stands for: the registered ``wait``
            of a batched future returns the list of results, in request order.
    """
    short = call.rsplit(".", 1)[-1]
    with record_function(f"distopt.wait:{short}"):
        try:
            spec = _find_spec(call)
            value = spec.wait(future) if spec is not None else future.wait()
            return value if item is None else value[item]
        except Exception as err:
            if getattr(err, "where", None) is not None:
                raise  # already names a source line
            message = _server_message(err)
            error = RemoteCallError(f"remote call {short} failed: {message} (called at {where})")
            error.server_message = str(err)  # type: ignore[attr-defined]
            error.where = where  # type: ignore[attr-defined]
            raise error from err


mark_side_effectful(remote_wait)
registry.register_leaf_function(remote_wait)


def is_wait(node: Node) -> bool:
    return node.op == "call_function" and node.target is remote_wait


_FRAME = re.compile(
    r'File "(?P<file>[^"]+)", line (?P<line>\d+), in [^\n]*\n[ \t]*(?P<code>[^\n]*)'
)


def source_line(node: Node) -> str:
    """``file:line: code`` of the user's call that created ``node`` (its innermost traced frame)."""
    trace = node.stack_trace or node.meta.get("stack_trace") or ""
    matches = list(_FRAME.finditer(trace))
    if not matches:
        return f"graph node {node.name}"
    last = matches[-1]
    return f"{last['file']}:{last['line']}: {last['code'].strip()}"
