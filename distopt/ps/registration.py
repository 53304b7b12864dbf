"""Declare the client's blocking calls to ``distopt.remote`` so the graph passes can schedule them.

What the passes get for ``distopt.ps.fetch(table, ids)``:

- ``issue``: :func:`~distopt.ps.client.fetch_async` (same arguments) → a ``FetchFuture``;
- ``wait``: :func:`~distopt.ps.client.wait` → exactly what ``fetch`` returns (rows as a leaf,
  recorded for ``push_gradients``); the wait runs in ``record_function("distopt.wait:ps.fetch:T")``;
- ``effect="read"``, ``resource=("distopt.ps", table)``: reads of any tables reorder freely; a read
  of ``T`` never moves above a write (push) of ``T``;
- ``batched``: :func:`~distopt.ps.client.fetch_batched` ``(list_of_args, list_of_kwargs)`` → one
  future; ``wait`` of it returns the list of rows in call order. Calls may be batched together when
  their ``batch_key`` (``("distopt.ps", servers holding the table)``) is equal; the batched call
  sends ONE request per server.

``distopt.ps.push(table, ids, grads, lr)`` is a write on the same resource, issued by
``push_async``. The server-side read handlers are declared with ``register_read`` in
``distopt.ps.server``, so raw ``rpc_sync("ps0", ps_server_fetch, args=(table, ids))`` is a read too.
"""

from __future__ import annotations

import sys
from typing import Any

from distopt.ps import client, context
from distopt.remote import register_remote
from distopt.verify import register_isolation_hook


def register(package_namespace: dict[str, Any] | None = None) -> None:
    """Register ``fetch`` and ``push``; ``package_namespace`` re-exports them (``distopt.ps``)."""
    namespaces = [vars(client)] + ([package_namespace] if package_namespace is not None else [])
    register_remote(
        client.fetch,
        issue=client.fetch_async,
        wait=client.wait,
        effect="read",
        resource=client.table_resource,
        batched=client.fetch_batched,
        batch_key=client.server_group,
        aliases=[(ns, "fetch") for ns in namespaces],
    )
    register_remote(
        client.push,
        issue=client.push_async,
        wait=client.wait,
        effect="write",
        resource=client.table_resource,
        aliases=[(ns, "push") for ns in namespaces],
    )


# distopt.optimize's verification runs forward/backward for real: the rows it fetches must not
# be pushed with the user's next push_gradients().
register_isolation_hook(context.isolated_step)

register(vars(sys.modules["distopt.ps"]) if "distopt.ps" in sys.modules else None)
