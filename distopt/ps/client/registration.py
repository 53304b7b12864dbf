"""Declare the client's blocking calls to ``distopt.remote`` so the graph passes can schedule them.

``distopt.ps.fetch(table, ids)`` is a read of resource ``("distopt.ps", table)``, issued by
``fetch_async`` and waited by ``wait``, batchable (:func:`fetch_batched`: ONE request per server)
with the calls whose tables live on the same servers; ``distopt.ps.push`` is a write of the same
resource, issued by ``push_async``. Details: ``docs/ps_runtime.md`` ("What the passes see").
"""

from __future__ import annotations

import sys
from collections.abc import Hashable, Mapping, Sequence
from typing import Any

from distopt.ps.client import calls, context
from distopt.ps.client.futures import FetchFuture
from distopt.remote import register_remote
from distopt.remote.isolation import register_isolation_hook


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
        wait_profiled=True,  # calls.wait opens the range "distopt.wait:ps.fetch:<table>"
    )
    register_remote(
        calls.push,
        issue=calls.push_async,
        wait=calls.wait,
        effect="write",
        resource=table_resource,
        aliases=[(ns, "push") for ns in namespaces],
        wait_profiled=True,
    )


# distopt.optimize's verification runs forward/backward for real: the rows it fetches must not
# be pushed with the user's next push_gradients().
register_isolation_hook(context.isolated_step)

register(vars(sys.modules["distopt.ps"]) if "distopt.ps" in sys.modules else None)
