"""Run convolutions and linears with their epilogues as oneDNN's fused ops on prepacked weights.

What Inductor's CPU backend emits for a frozen conv net, as a graph rewrite that takes
milliseconds instead of a compile: each convolution becomes one
``mkldnn._convolution_pointwise`` call whose weights (BatchNorm already folded by
``fold_conv_bn``) are reordered into oneDNN's blocked layout once, with the residual add and the
activation that follow it done in the same kernel (``conv+add+relu`` in a ResNet block); a
linear followed by an activation, a per-channel scale (a layer scale) or a residual add becomes one
``mkldnn._linear_pointwise`` call (``linear+gelu``, ``scale·linear + residual`` in a ConvNeXt
block). The graph is run channels-last, the layout these kernels produce, with outputs restored to
the original layout.

CPU and float32 only (the ops are CPU ops; on CUDA the pass does nothing), eval mode only (the
fused ops have no backward: a call that needs gradients computes the original chain instead, see
:mod:`~distopt.passes.local.fused`), and kept only where it measured faster.
"""

from __future__ import annotations

import dataclasses
import operator
from typing import Any

import torch
import torch.fx
from torch.fx import Node

from distopt.passes.core.pass_base import PassContext, PassResult, PassSpec
from distopt.passes.core.runner import REORDERS_FLOAT
from distopt.passes.local.channels_last import (
    convert_layout,
    has_convolutions,
    is_converted,
    output_formats,
)
from distopt.passes.local.fused import Epilogue, FusedConv2d, FusedLinear
from distopt.passes.local.measured import add_fused, keep_if_faster
from distopt.passes.local.patterns import (
    as_add,
    as_conv,
    as_linear,
    as_unary,
    materialize,
    module_of,
    moves_safely,
    sole_user,
)


def mkldnn_fusion(gm: torch.fx.GraphModule, ctx: PassContext) -> PassResult:
    """Fuse conv/linear epilogues into oneDNN ops with prepacked weights (CPU eval graphs).

    Before::

        distopt_fused_conv3 = self.distopt_fused.conv3(relu_1, ...)   # conv + folded BatchNorm
        add = distopt_fused_conv3 + x;  relu_2 = torch.relu(add)

    After::

        distopt_fused_conv3_1 = self.distopt_fused.conv3_1(relu_1, ..., x)   # conv+add+relu, oneDNN
    """
    if ctx.training:
        return PassResult(
            modified=False, detail="training mode: the fused oneDNN ops have no backward"
        )
    unavailable = _unavailable(gm, ctx)
    if unavailable is not None:
        return PassResult(modified=False, detail=unavailable)

    def rewrite(gm: torch.fx.GraphModule) -> tuple[bool, str]:
        # The outputs' layouts the conversion back restores: the graph's own, before fusing.
        convert = has_convolutions(gm) and not is_converted(gm)
        formats = output_formats(gm, ctx.example_inputs) if convert else None
        convs = _fuse_convolutions(gm)
        linears = _fuse_linears(gm)
        if not convs and not linears:
            return False, "no convolution or linear epilogue to fuse"
        layout = ""
        if convert:
            converted, restored = convert_layout(gm, ctx, formats)
            layout = f"; channels-last: {converted} inputs converted, {restored} outputs restored"
        kinds = ", ".join(f"{n}× {k}" for k, n in sorted(convs.items()) + sorted(linears.items()))
        return True, f"oneDNN fused ops: {kinds}{layout}"

    return keep_if_faster(gm, ctx, rewrite)


def _unavailable(gm: torch.fx.GraphModule, ctx: PassContext) -> str | None:
    if not torch.backends.mkldnn.is_available():
        return "this torch build has no oneDNN (mkldnn)"
    tensors = [t for t in ctx.example_inputs or () if isinstance(t, torch.Tensor)]
    tensors += list(gm.parameters())
    tensors += [
        v
        for n in gm.graph.nodes
        if n.op == "placeholder" and isinstance(v := n.meta.get("example_value"), torch.Tensor)
    ]
    devices = {t.device.type for t in tensors}
    if devices - {"cpu"}:
        return f"tensors on {', '.join(sorted(devices - {'cpu'}))}: the oneDNN ops are CPU ops"
    floats = {t.dtype for t in tensors if t.is_floating_point()}
    if floats - {torch.float32}:
        return f"floating-point types {sorted(str(d) for d in floats)}: fused ops run float32 graphs only"
    return None


@dataclasses.dataclass
class _Chain:
    """The nodes an epilogue absorbs after the conv or linear, and what they add."""

    absorbed: list[Node] = dataclasses.field(default_factory=list)
    other: Any = None
    unary: str | None = None
    gelu_approximate: str = "none"


def _grow(gm: torch.fx.GraphModule, start: Node, chain: _Chain, *, add: bool, unary: bool) -> Node:
    """Absorb an add (if ``add``) then an activation (if ``unary``) that solely use ``start``'s
    value; returns the node whose value the fused call stands for."""
    current = start
    user = sole_user(current)
    if add and user is not None:
        other = as_add(user, current)
        if other is not None:
            chain.absorbed.append(user)
            chain.other = other
            current = user
            user = sole_user(current)
    if unary and user is not None:
        act = as_unary(gm, user)
        # oneDNN fuses only ReLU after a binary post-op.
        if act is not None and act.x is current and (chain.other is None or act.name == "relu"):
            chain.absorbed.append(user)
            chain.unary, chain.gelu_approximate = act.name, act.gelu_approximate
            current = user
    return current


def _conv_base(gm: torch.fx.GraphModule, node: Node) -> tuple[FusedConv2d, Any, list[Any]] | None:
    """The convolution ``node`` computes as an aten-kernel :class:`FusedConv2d` (one folded by
    ``fold_conv_bn`` as it is), its input and its six tensor operands."""
    folded = module_of(gm, node)
    if isinstance(folded, FusedConv2d):
        if folded.kernel != "aten":
            return None
        return folded, node.args[0], [*node.args[1:7], *[None] * (7 - len(node.args))]
    conv = as_conv(gm, node)
    if conv is None:
        return None
    module = FusedConv2d(
        stride=conv.stride,
        padding=conv.padding,
        dilation=conv.dilation,
        groups=conv.groups,
        epilogue=Epilogue(),
        origin=conv.origin,
    )
    return module, conv.x, [conv.weight, conv.bias, None, None, None, None]


def _fuse_convolutions(gm: torch.fx.GraphModule) -> dict[str, int]:
    counts: dict[str, int] = {}
    for node in list(gm.graph.nodes):
        base = _conv_base(gm, node)
        if base is None:
            continue
        conv, x, operands = base
        ep = conv.epilogue
        chain = _Chain()
        last = _grow(gm, node, chain, add=not ep.add, unary=ep.unary is None)
        if not moves_safely(node, last):
            chain, last = _Chain(), node
        epilogue = dataclasses.replace(
            ep,
            add=ep.add or chain.other is not None,
            unary=ep.unary or chain.unary,
            gelu_approximate=chain.gelu_approximate if chain.unary else ep.gelu_approximate,
        )
        module = conv.with_kernel("mkldnn", epilogue)
        target = add_fused(gm, module.origin.split("+")[0] or node.name, module)
        args = [materialize(gm, last, t) for t in operands] + [chain.other]
        with gm.graph.inserting_before(last):
            new = gm.graph.call_module(target, (x, *args))
        new.meta = {**last.meta, REORDERS_FLOAT: True}
        last.replace_all_uses_with(new)
        for dead in reversed(chain.absorbed):
            gm.graph.erase_node(dead)
        gm.graph.erase_node(node)
        kind = "conv" + "".join(f"+{k}" for k in epilogue.describe().split("+") if k != "none")
        counts[kind] = counts.get(kind, 0) + 1
    return counts


def _fuse_linears(gm: torch.fx.GraphModule) -> dict[str, int]:
    """Linears with something to fuse: an activation, or a layer scale and/or a residual add."""
    counts: dict[str, int] = {}
    for node in list(gm.graph.nodes):
        linear = as_linear(gm, node)
        if linear is None:
            continue
        chain = _Chain()
        scale = _layer_scale(gm, node, linear.weight)
        start = node
        if scale is not None:
            chain.absorbed.append(scale[0])
            start = scale[0]
        last = _grow(gm, start, chain, add=True, unary=False)
        permuted = None
        if chain.other is None:
            last = _grow(gm, start, chain, add=False, unary=True)
            if chain.unary is None:
                permuted = _permuted_add(start)
        if scale is None and chain.other is None and chain.unary is None and permuted is None:
            continue
        if permuted is not None:
            permute, add, residual, dims = permuted
            last = add
        if not moves_safely(node, last):
            continue
        epilogue = Epilogue(
            scale=scale is not None,
            add=chain.other is not None or permuted is not None,
            unary=chain.unary,
            gelu_approximate=chain.gelu_approximate,
        )
        target = add_fused(gm, linear.origin, FusedLinear(epilogue=epilogue, origin=linear.origin))
        weight, bias = materialize(gm, last, linear.weight), materialize(gm, last, linear.bias)
        scale_value = scale[1] if scale is not None else None
        with gm.graph.inserting_before(last):
            if permuted is not None:
                # add(r, permute(y, p)) == permute(y + permute(r, p⁻¹), p): the add moves into the linear.
                inverse = [dims.index(i) for i in range(len(dims))]
                other = gm.graph.call_method("permute", (residual, *inverse))
                fused = gm.graph.call_module(target, (linear.x, weight, bias, scale_value, other))
                new = gm.graph.call_method("permute", (fused, *dims))
                fused.meta[REORDERS_FLOAT] = True
            else:
                new = gm.graph.call_module(
                    target, (linear.x, weight, bias, scale_value, chain.other)
                )
        new.meta = {**last.meta, REORDERS_FLOAT: True}
        last.replace_all_uses_with(new)
        dead = [last, permute] if permuted is not None else []
        for node_ in dead + [n for n in reversed(chain.absorbed) if n not in dead]:
            gm.graph.erase_node(node_)
        gm.graph.erase_node(node)
        kind = "linear" + "".join(f"+{k}" for k in epilogue.describe().split("+") if k != "none")
        counts[kind] = counts.get(kind, 0) + 1
    return counts


def _layer_scale(gm: torch.fx.GraphModule, node: Node, weight: Any) -> tuple[Node, Node] | None:
    """``(mul, scale)`` when ``node``'s sole user multiplies it by a 1-D tensor of its width."""
    user = sole_user(node)
    if user is None or user.op != "call_function" or user.kwargs or len(user.args) != 2:
        return None
    if user.target not in (operator.mul, torch.mul):
        return None
    a, b = user.args
    scale = b if a is node else a if b is node else None
    if not isinstance(scale, Node) or scale is node:
        return None
    shape = _static_shape(gm, scale)
    if isinstance(weight, str):
        out: tuple[int, ...] | None = tuple(gm.get_parameter(weight).shape)
    else:
        out = _static_shape(gm, weight) if isinstance(weight, Node) else None
    if shape is None or out is None or shape != out[:1]:
        return None
    return user, scale


def _static_shape(gm: torch.fx.GraphModule, node: Node) -> tuple[int, ...] | None:
    """The shape a parameter, buffer or Dynamo placeholder always has (``None``: unknown)."""
    if node.op == "get_attr":
        owner, _, name = str(node.target).rpartition(".")
        try:
            value = getattr(gm.get_submodule(owner), name)
        except AttributeError:
            return None
        return tuple(value.shape) if isinstance(value, torch.Tensor) else None
    example = node.meta.get("example_value")
    if node.op == "placeholder" and isinstance(example, torch.Tensor):
        return tuple(example.shape)
    return None


def _permuted_add(start: Node) -> tuple[Node, Node, Node, list[int]] | None:
    """``(permute, add, residual, dims)`` for ``add(residual, permute(start, dims))`` where the
    residual has the permuted value's shape (known from Dynamo's metadata)."""
    permute = sole_user(start)
    if (
        permute is None
        or permute.op != "call_method"
        or permute.target != "permute"
        or permute.kwargs
    ):
        return None
    raw = list(permute.args[1:])
    if len(raw) == 1 and isinstance(raw[0], (list, tuple)):
        raw = list(raw[0])
    dims = [d for d in raw if isinstance(d, int)]
    if not dims or len(dims) != len(raw) or sorted(dims) != list(range(len(dims))):
        return None
    add = sole_user(permute)
    residual = as_add(add, permute) if add is not None else None
    if add is None or not isinstance(residual, Node):
        return None
    value, res = permute.meta.get("example_value"), residual.meta.get("example_value")
    if (
        not isinstance(value, torch.Tensor)
        or not isinstance(res, torch.Tensor)
        or value.shape != res.shape
    ):
        return None
    return permute, add, residual, dims


PASS = PassSpec(
    name="mkldnn_fusion",
    fn=mkldnn_fusion,
    after=("fold_conv_bn",),
    before=("channels_last",),
    options=("measure",),
)
"""This module's pass, listed with the other built-ins in :mod:`distopt.passes`."""
