"""Fold eval-mode BatchNorm into the convolution before it (inference graphs only).

In eval mode ``bn(conv(x)) = conv'(x)`` with ``w' = w·γ/σ`` and ``b' = (b − μ)·γ/σ + β``: one
kernel instead of two passes over the activation. In training mode BatchNorm uses batch statistics
and updates its running stats, so folding would change results: the pass leaves training graphs
alone and says so.

The pair becomes one :class:`~distopt.passes.local.fused.FusedConv2d` call that still receives the
conv's and BatchNorm's own tensors, so ``state_dict()`` keys and values are the model's; the folded
weights are derived from them and recomputed whenever one changes (a checkpoint load, an in-place
update). Only a convolution whose sole user is the BatchNorm folds: a conv module called a second
time on a path without BatchNorm keeps computing the plain convolution there.
"""

from __future__ import annotations

import torch
import torch.fx

from distopt.passes.core.pass_base import PassContext, PassResult, PassSpec
from distopt.passes.core.runner import REORDERS_FLOAT
from distopt.passes.local.fused import Epilogue, FusedConv2d
from distopt.passes.local.measured import add_fused
from distopt.passes.local.patterns import (
    as_conv,
    as_eval_batch_norm,
    is_batch_norm,
    is_convolution,
    materialize,
    moves_safely,
    sole_user,
)
from distopt.text import plural


def fold_conv_bn(gm: torch.fx.GraphModule, ctx: PassContext) -> PassResult:
    """Replace ``bn(conv(x))`` by one convolution on folded weights (eval mode only).

    Before::

        conv1 = self.conv1(x);  bn1 = self.bn1(conv1)

    After::

        conv1_weight = self.conv1.weight;  ...;  bn1_running_mean = self.bn1.running_mean;  ...
        distopt_fused_conv1 = self.distopt_fused.conv1(x, conv1_weight, None, bn1_running_mean, ...)
    """
    pairs = _conv_batch_norm_pairs(gm)
    if not pairs:
        return PassResult(modified=False, detail="no convolution followed by BatchNorm to fold")
    if ctx.training:
        return PassResult(
            modified=False,
            detail=(
                "training mode: BatchNorm normalizes with batch statistics, "
                f"{plural(pairs, 'conv+batchnorm pair')} left unfolded"
            ),
        )
    folded = 0
    for node in list(gm.graph.nodes):
        bn = as_eval_batch_norm(gm, node)
        source = bn.x if bn is not None else None
        if bn is None or not isinstance(source, torch.fx.Node) or sole_user(source) is not node:
            continue
        conv = as_conv(gm, source)
        if conv is None or not moves_safely(conv.node, bn.node):
            continue
        module = FusedConv2d(
            stride=conv.stride,
            padding=conv.padding,
            dilation=conv.dilation,
            groups=conv.groups,
            epilogue=Epilogue(batch_norm_eps=bn.eps),
            origin=f"{conv.origin}+{bn.origin}",
        )
        target = add_fused(gm, conv.origin, module)
        operands = [
            materialize(gm, conv.node, t)
            for t in (conv.weight, conv.bias, bn.mean, bn.var, bn.weight, bn.bias)
        ]
        with gm.graph.inserting_before(conv.node):
            new = gm.graph.call_module(target, (conv.x, *operands))
        new.meta = {**conv.node.meta, REORDERS_FLOAT: True}
        bn.node.replace_all_uses_with(new)
        gm.graph.erase_node(bn.node)
        gm.graph.erase_node(conv.node)
        folded += 1
    return PassResult(modified=folded > 0, detail=f"folded {plural(folded, 'conv+batchnorm pair')}")


def _conv_batch_norm_pairs(gm: torch.fx.GraphModule) -> int:
    """How many BatchNorms (either mode) normalize a convolution's output."""
    return sum(
        1
        for node in gm.graph.nodes
        if is_batch_norm(gm, node)
        and node.args
        and isinstance(node.args[0], torch.fx.Node)
        and is_convolution(gm, node.args[0])
    )


PASS = PassSpec(name="fold_conv_bn", fn=fold_conv_bn, after=("remove_identity",))
"""This module's pass, listed with the other built-ins in :mod:`distopt.passes`."""
