"""Arguments of a captured remote-call node as the registry's effect/resource functions see them.

The tracer stores functions passed as arguments (``rpc_sync(to, fetch_rows, ...)``) as GraphModule
attributes read by ``get_attr`` nodes; the registry needs the real function to decide a call's effect.
"""

from __future__ import annotations

from typing import Any

import torch.fx

MISSING = object()
"""What :func:`attr_value` returns for a node that reads no available attribute."""


def attr_value(node: torch.fx.Node) -> Any:
    """The object a ``get_attr`` node reads from its GraphModule (``MISSING`` if unavailable)."""
    module = node.graph.owning_module
    if node.op != "get_attr" or module is None:
        return MISSING
    value: Any = module
    for part in str(node.target).split("."):
        value = getattr(value, part, MISSING)
        if value is MISSING:
            break
    return value


def concrete_args(node: torch.fx.Node) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``node``'s args and kwargs with ``get_attr`` nodes replaced by the attribute's value.

    Other graph nodes stay as nodes.
    """

    def value(arg: Any) -> Any:
        if isinstance(arg, torch.fx.Node):
            found = attr_value(arg)
            return arg if found is MISSING else found
        return arg

    args = torch.fx.node.map_aggregate(node.args, value)
    kwargs = torch.fx.node.map_aggregate(node.kwargs, value)
    return tuple(args), dict(kwargs)
