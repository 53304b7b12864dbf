"""Which nodes dead-code elimination must keep even when their results are unused."""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

import torch
import torch.fx

from distopt.remote import registry

_IMPURE_TARGETS: set[int] = {id(operator.setitem), id(operator.delitem)}


def mark_side_effectful(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Declare that calls to ``fn`` must never be dropped (torch.fx's ``has_side_effect``)."""
    return torch.fx.node.has_side_effect(fn)


def _is_inplace(node: torch.fx.Node) -> bool:
    target = node.target
    if node.op == "call_method":
        name = str(target)
        return name.endswith("_") and not name.endswith("__")
    if node.op == "call_function":
        name = getattr(target, "__name__", "")
        if isinstance(target, torch._ops.OpOverload):
            return target._schema.is_mutable
        return name.endswith("_") and not name.endswith("__") and not name.startswith("_")
    return False


def is_impure(node: torch.fx.Node) -> bool:
    """True for nodes with effects: remote calls, registered effectful functions, in-place ops."""
    if node.op == "call_function":
        if id(node.target) in _IMPURE_TARGETS or registry.is_remote_call(node.target):
            return True
    if node.meta.get("distopt_side_effect"):
        return True
    if _is_inplace(node):
        return True
    return node.is_impure()


def eliminate_dead_code(gm: torch.fx.GraphModule) -> int:
    """Drop unused pure nodes; return how many were removed."""
    before = len(gm.graph.nodes)
    gm.graph.eliminate_dead_code(is_impure_node=is_impure)
    return before - len(gm.graph.nodes)
