"""Declare the client's blocking calls to ``distopt.remote`` so the graph passes can schedule them.

What the passes get for ``distopt.ps.fetch(table, ids)``:

- ``issue``: :func:`~distopt.ps.client.calls.fetch_async` (same arguments) → a ``FetchFuture``;
- ``wait``: :func:`~distopt.ps.client.calls.wait` → exactly what ``fetch`` returns (rows as a leaf,
  recorded for ``push_gradients``); the wait runs in ``record_function("distopt.wait:ps.fetch:T")``;
- ``effect="read"``, ``resource=("distopt.ps", table)``: reads of any tables reorder freely; a read
  of ``T`` never moves above a write (push) of ``T``;
- ``batched``: :func:`fetch_batched` ``(list_of_args, list_of_kwargs)`` → one
  future; ``wait`` of it returns the list of rows in call order. Calls may be batched together when
  their ``batch_key`` (``("distopt.ps", servers holding the table)``) is equal; the batched call
  sends ONE request per server.

``distopt.ps.push(table, ids, grads, lr)`` is a write on the same resource, issued by
``push_async``. The server-side read handlers are declared with ``register_read`` in
:mod:`distopt.ps.transport.rpc`, so a raw ``rpc_sync("ps0", ps_server_fetch, args=(table, ids))``
is a read too.
"""

from __future__ import annotations

import sys
from collections.abc import Hashable, Mapping, Sequence
from typing import Any

from distopt.ps.client import calls, context
from distopt.ps.client.futures import FetchFuture
from distopt.remote import register_remote
from distopt.verify import register_isolation_hook


def _arg(args: Sequence[Any], kwargs: Mapping[str, Any], index: int, name: str) -> Any:
    return args[index] if len(args) > index else kwargs.get(name)


def table_resource(args: Sequence[Any], kwargs: Mapping[str, Any]) -> Hashable:
    """Resource of a fetch/push call: ``("distopt.ps", table)``; equal resources conflict."""
    return ("distopt.ps", _arg(args, kwargs, 0, "table"))


def server_group(args: Sequence[Any], kwargs: Mapping[str, Any]) -> Hashable:
    """Batch key of a fetch: the servers holding its table (unknown before ``init_trainer``)."""
    route = calls.routes().get(_arg(args, kwargs, 0, "table")) if calls.is_connected() else None
    return ("distopt.ps", route.servers if route is not None else None)


def fetch_batched(
    args_list: Sequence[Sequence[Any]], kwargs_list: Sequence[Mapping[str, Any]]
) -> FetchFuture:
    """Batched form of ``fetch`` for the batch pass: ``wait`` of the result is a list of rows."""
    requests = [
        (_arg(a, k, 0, "table"), _arg(a, k, 1, "ids"))
        for a, k in zip(args_list, kwargs_list, strict=True)
    ]
    return calls.fetch_many_async(requests)


def register(package_namespace: dict[str, Any] | None = None) -> None:
    """Register ``fetch`` and ``push``; ``package_namespace`` re-exports them (``distopt.ps``)."""
    namespaces = [vars(calls)] + ([package_namespace] if package_namespace is not None else [])
    register_remote(
        calls.fetch,
        issue=calls.fetch_async,
        wait=calls.wait,
        effect="read",
        resource=table_resource,
        batched=fetch_batched,
        batch_key=server_group,
        aliases=[(ns, "fetch") for ns in namespaces],
    )
    register_remote(
        calls.push,
        issue=calls.push_async,
        wait=calls.wait,
        effect="write",
        resource=table_resource,
        aliases=[(ns, "push") for ns in namespaces],
    )


# distopt.optimize's verification runs forward/backward for real: the rows it fetches must not
# be pushed with the user's next push_gradients().
register_isolation_hook(context.isolated_step)

register(vars(sys.modules["distopt.ps"]) if "distopt.ps" in sys.modules else None)
