"""Recognize convolutions, BatchNorm, linears, activations and adds however a graph spells them.

A symbolically traced graph calls modules (``call_module conv1``); a Dynamo graph calls functions
on parameters that arrive as placeholders (``torch.conv2d(x, l_self_conv1_weight_, ...)``). The
fusion passes read both through these helpers: each returns the op's operands, or ``None`` when
the node is not that op in a form the passes handle. Recognizing changes nothing: a module's
tensors are named by attribute path (:data:`Operand`) until a pass that rewrites the call
materializes them as ``get_attr`` nodes (:func:`materialize`).
"""

from __future__ import annotations

import dataclasses
import operator
from typing import Any

import torch
import torch.fx
from torch import nn
from torch.fx import Node
from torch.nn import functional as F

from distopt.passes.local.fused import FusedConv2d
from distopt.remote.side_effects import is_impure

Operand = Node | str | None
"""A tensor operand: a graph value, a module tensor's attribute path (``"layer1.conv1.weight"``),
or absent."""


@dataclasses.dataclass
class Conv:
    node: Node
    x: Any
    weight: Operand
    bias: Operand
    stride: tuple[int, int]
    padding: tuple[int, int]
    dilation: tuple[int, int]
    groups: int
    origin: str
    """The module path or node name, for reports."""


@dataclasses.dataclass
class BatchNorm:
    node: Node
    x: Any
    mean: Operand
    var: Operand
    weight: Operand
    bias: Operand
    eps: float
    origin: str


@dataclasses.dataclass
class Linear:
    node: Node
    x: Any
    weight: Operand
    bias: Operand
    origin: str


@dataclasses.dataclass
class Unary:
    node: Node
    x: Any
    name: str
    """A key of :data:`distopt.passes.local.fused.UNARY`."""
    gelu_approximate: str = "none"


def _pair(value: Any) -> tuple[int, int] | None:
    if isinstance(value, int):
        return (value, value)
    if (
        isinstance(value, (tuple, list))
        and len(value) == 2
        and all(isinstance(v, int) for v in value)
    ):
        return (value[0], value[1])
    return None


def materialize(gm: torch.fx.GraphModule, before: Node, operand: Operand) -> Node | None:
    """``operand`` as a graph value: a ``get_attr`` inserted before ``before`` for a module tensor."""
    if isinstance(operand, str):
        with gm.graph.inserting_before(before):
            return gm.graph.get_attr(operand)
    return operand


def _bound(node: Node, names: tuple[str, ...], defaults: dict[str, Any]) -> dict[str, Any] | None:
    """``node``'s positional and keyword arguments by parameter name (``None``: unknown keywords)."""
    if len(node.args) > len(names) or set(node.kwargs) - set(names):
        return None
    bound = dict(defaults)
    bound.update(zip(names, node.args, strict=False))
    bound.update(node.kwargs)
    return bound


def module_of(gm: torch.fx.GraphModule, node: Node) -> nn.Module | None:
    if node.op != "call_module":
        return None
    try:
        return gm.get_submodule(str(node.target))
    except AttributeError:
        return None


_CONV_FUNCTIONS = (torch.conv2d, F.conv2d)
_CONV_ARGS = ("input", "weight", "bias", "stride", "padding", "dilation", "groups")


def as_conv(gm: torch.fx.GraphModule, node: Node) -> Conv | None:
    """A 2-D convolution with zero padding given as numbers (not ``"same"``)."""
    module = module_of(gm, node)
    if module is not None:
        if (
            type(module) is not nn.Conv2d
            or module.padding_mode != "zeros"
            or len(node.args) != 1
            or node.kwargs
        ):
            return None
        padding = _pair(module.padding)
        if padding is None:
            return None
        path = str(node.target)
        return Conv(
            node,
            node.args[0],
            f"{path}.weight",
            f"{path}.bias" if module.bias is not None else None,
            _pair(module.stride) or (1, 1),
            padding,
            _pair(module.dilation) or (1, 1),
            module.groups,
            path,
        )
    if node.op != "call_function" or node.target not in _CONV_FUNCTIONS:
        return None
    args = _bound(
        node, _CONV_ARGS, {"bias": None, "stride": 1, "padding": 0, "dilation": 1, "groups": 1}
    )
    if args is None or not isinstance(args.get("weight"), Node):
        return None
    stride, padding, dilation = (
        _pair(args["stride"]),
        _pair(args["padding"]),
        _pair(args["dilation"]),
    )
    bias = args["bias"]
    if stride is None or padding is None or dilation is None or not isinstance(args["groups"], int):
        return None
    if bias is not None and not isinstance(bias, Node):
        return None
    return Conv(
        node,
        args["input"],
        args["weight"],
        bias,
        stride,
        padding,
        dilation,
        args["groups"],
        node.name,
    )


_BN_ARGS = ("input", "running_mean", "running_var", "weight", "bias", "training", "momentum", "eps")


def as_eval_batch_norm(gm: torch.fx.GraphModule, node: Node) -> BatchNorm | None:
    """BatchNorm normalizing with its running statistics (eval mode)."""
    module = module_of(gm, node)
    if module is not None:
        if not isinstance(module, nn.BatchNorm2d) or len(node.args) != 1 or node.kwargs:
            return None
        if module.training or not module.track_running_stats or module.running_mean is None:
            return None
        path = str(node.target)
        affine = module.affine
        return BatchNorm(
            node,
            node.args[0],
            f"{path}.running_mean",
            f"{path}.running_var",
            f"{path}.weight" if affine else None,
            f"{path}.bias" if affine else None,
            float(module.eps),
            path,
        )
    if node.op != "call_function" or node.target is not F.batch_norm:
        return None
    args = _bound(
        node,
        _BN_ARGS,
        {"weight": None, "bias": None, "training": False, "momentum": 0.1, "eps": 1e-5},
    )
    if args is None or args["training"] is not False or not isinstance(args["eps"], float):
        return None
    mean, var, weight, bias = (
        args["running_mean"],
        args["running_var"],
        args["weight"],
        args["bias"],
    )
    if not isinstance(mean, Node) or not isinstance(var, Node):
        return None
    if any(v is not None and not isinstance(v, Node) for v in (weight, bias)):
        return None
    return BatchNorm(node, args["input"], mean, var, weight, bias, args["eps"], node.name)


def as_linear(gm: torch.fx.GraphModule, node: Node) -> Linear | None:
    module = module_of(gm, node)
    if module is not None:
        if type(module) is not nn.Linear or len(node.args) != 1 or node.kwargs:
            return None
        path = str(node.target)
        bias = f"{path}.bias" if module.bias is not None else None
        return Linear(node, node.args[0], f"{path}.weight", bias, path)
    if node.op != "call_function" or node.target is not F.linear:
        return None
    args = _bound(node, ("input", "weight", "bias"), {"bias": None})
    if args is None or not isinstance(args["weight"], Node):
        return None
    if args["bias"] is not None and not isinstance(args["bias"], Node):
        return None
    return Linear(node, args["input"], args["weight"], args["bias"], node.name)


_UNARY_MODULES: dict[type[nn.Module], str] = {
    nn.ReLU: "relu",
    nn.GELU: "gelu",
    nn.SiLU: "swish",
    nn.Sigmoid: "sigmoid",
    nn.Tanh: "tanh",
    nn.Hardswish: "hardswish",
}
_UNARY_FUNCTIONS: dict[Any, str] = {
    F.relu: "relu",
    torch.relu: "relu",
    torch.relu_: "relu",
    F.relu_: "relu",
    F.gelu: "gelu",
    F.silu: "swish",
    torch.sigmoid: "sigmoid",
    F.sigmoid: "sigmoid",
    torch.tanh: "tanh",
    F.tanh: "tanh",
    F.hardswish: "hardswish",
}
_UNARY_METHODS = {"relu": "relu", "relu_": "relu", "sigmoid": "sigmoid", "tanh": "tanh"}


def as_unary(gm: torch.fx.GraphModule, node: Node) -> Unary | None:
    """An activation of :data:`~distopt.passes.local.fused.UNARY` applied to one tensor."""
    module = module_of(gm, node)
    if module is not None:
        name = _UNARY_MODULES.get(type(module))
        if name is None or len(node.args) != 1 or node.kwargs:
            return None
        approximate = getattr(module, "approximate", "none")
        return Unary(node, node.args[0], name, approximate)
    if node.op == "call_method":
        name = _UNARY_METHODS.get(str(node.target))
        return (
            Unary(node, node.args[0], name)
            if name and len(node.args) == 1 and not node.kwargs
            else None
        )
    if node.op != "call_function" or not node.args:
        return None
    try:
        name = _UNARY_FUNCTIONS.get(node.target)
    except TypeError:  # an unhashable target
        return None
    if name is None or len(node.args) != 1 or set(node.kwargs) - {"inplace", "approximate"}:
        return None
    approximate = node.kwargs.get("approximate", "none")
    if name == "gelu" and approximate not in ("none", "tanh"):
        return None
    return Unary(node, node.args[0], name, str(approximate))


_ADDS = (operator.add, operator.iadd, torch.add)


def as_add(node: Node, value: Node) -> Any:
    """The other operand when ``node`` adds a tensor to ``value`` without writing into that
    other operand; ``None`` otherwise (an ``alpha``, a scalar, an in-place add into the other)."""
    if node.kwargs or len(node.args) != 2:
        return None
    a, b = node.args
    if node.op == "call_function" and node.target in _ADDS:
        in_place = node.target is operator.iadd
    elif node.op == "call_method" and node.target in ("add", "add_"):
        in_place = node.target == "add_"
    else:
        return None
    if a is value and b is not value:
        other = b
    elif b is value and a is not value and not in_place:
        other = a
    else:
        return None
    return other if isinstance(other, Node) else None


def sole_user(node: Node) -> Node | None:
    users = list(node.users)
    return users[0] if len(users) == 1 else None


def moves_safely(first: Node, last: Node) -> bool:
    """Computing ``first``'s op at ``last``'s place (or ``last``'s at ``first``'s) changes nothing:
    no node in between writes in place or has other effects (it could write an operand)."""
    node = first.next
    while node is not last:
        if node.op == "output" or is_impure(node):
            return False
        node = node.next
    return True


def is_batch_norm(gm: torch.fx.GraphModule, node: Node) -> bool:
    """Any BatchNorm, in training or eval mode (unlike :func:`as_eval_batch_norm`)."""
    module = module_of(gm, node)
    if module is not None:
        return isinstance(module, nn.modules.batchnorm._BatchNorm)
    return node.op == "call_function" and node.target in (F.batch_norm, torch.batch_norm)


def is_convolution(gm: torch.fx.GraphModule, node: Node) -> bool:
    """Any 2-D convolution, fused or not (no graph changes, unlike :func:`as_conv`)."""
    module = module_of(gm, node)
    if module is not None:
        return isinstance(module, (nn.Conv2d, FusedConv2d))
    return node.op == "call_function" and node.target in _CONV_FUNCTIONS
