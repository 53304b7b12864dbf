"""Fold eval-mode BatchNorm into the convolution before it (inference graphs only).

In eval mode ``bn(conv(x)) = conv'(x)`` with ``w' = w·γ/σ`` and ``b' = (b − μ)·γ/σ + β``: one
kernel instead of two passes over the activation. In training mode BatchNorm uses batch statistics
and updates its running stats, so folding would change results: the pass refuses.

The folded weights are *non-persistent buffers* of new ``distopt_folded`` submodules; the original
conv and BatchNorm stay registered, so ``state_dict()`` keys and values are the model's, and
loading a checkpoint re-folds (a ``load_state_dict`` post-hook).
"""

from __future__ import annotations

from typing import cast

import torch
import torch.fx
from torch import nn
from torch.nn import functional as F

from distopt.errors import ConfigError
from distopt.passes.core.base import PassContext, PassResult, PassSpec
from distopt.text import plural

FOLDED = "distopt_folded"


class FoldedConv2d(nn.Module):
    """``conv`` followed by eval ``bn``, as one convolution; weights recomputed by :meth:`refold`."""

    weight: torch.Tensor  # non-persistent buffers registered in __init__
    bias: torch.Tensor

    def __init__(self, conv: nn.Conv2d, bn: nn.BatchNorm2d, conv_path: str, bn_path: str):
        super().__init__()
        self.conv_path, self.bn_path = conv_path, bn_path
        self.train(False)  # created for an eval graph; forward refuses training mode
        self.stride, self.padding, self.dilation, self.groups = (
            conv.stride,
            conv.padding,
            conv.dilation,
            conv.groups,
        )
        if conv.padding_mode != "zeros":
            raise ConfigError(
                f"fold_conv_bn: {conv_path} uses padding_mode={conv.padding_mode!r}; only 'zeros' folds"
            )
        self.register_buffer("weight", torch.empty(0), persistent=False)
        self.register_buffer("bias", torch.empty(0), persistent=False)
        self.refold(conv, bn)

    @torch.no_grad()
    def refold(self, conv: nn.Conv2d, bn: nn.BatchNorm2d) -> None:
        # fold_conv_bn only folds BatchNorms that track running stats: both are tensors.
        mean, var = cast(torch.Tensor, bn.running_mean), cast(torch.Tensor, bn.running_var)
        w, b = torch.nn.utils.fusion.fuse_conv_bn_weights(
            conv.weight, conv.bias, mean, var, bn.eps, bn.weight, bn.bias
        )
        # Keep the layout the channels-last pass chose when re-folding after a checkpoint load.
        nhwc = self.weight.dim() == 4 and not self.weight.is_contiguous()
        fmt = torch.channels_last if nhwc else torch.contiguous_format
        self.weight = w.detach().contiguous(memory_format=fmt)
        self.bias = b.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            # Folded weights bake in eval-mode statistics: training through them is silently wrong.
            raise ConfigError(
                f"{self.conv_path}+{self.bn_path} were folded for eval by distopt; call .eval(), or "
                "optimize the training model without the fold_conv_bn pass"
            )
        return F.conv2d(
            x, self.weight, self.bias, self.stride, self.padding, self.dilation, self.groups
        )


def _refold_all(module: nn.Module, incompatible_keys: object) -> None:
    """``load_state_dict`` post-hook: recompute folded weights from the loaded conv/BN state."""
    folded = getattr(module, FOLDED, None)
    if folded is None:
        return
    for sub in folded.children():
        assert isinstance(sub, FoldedConv2d)
        # The paths name the Conv2d and BatchNorm2d that fold_conv_bn folded.
        conv = cast(nn.Conv2d, module.get_submodule(sub.conv_path))
        bn = cast(nn.BatchNorm2d, module.get_submodule(sub.bn_path))
        sub.refold(conv, bn)


def fold_conv_bn(gm: torch.fx.GraphModule, ctx: PassContext) -> PassResult:
    """Replace ``bn(conv(x))`` by one folded convolution (eval mode only).

    Before::

        conv1 = self.conv1(x);  bn1 = self.bn1(conv1)

    After::

        distopt_folded_conv1 = self.distopt_folded.conv1(x)
    """
    if ctx.training:
        raise ConfigError(
            "fold_conv_bn: the model is in training mode; folding BatchNorm is only exact in eval mode "
            "(call model.eval() first, or drop the pass)"
        )
    modules = dict(gm.named_modules())
    folded = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_module" or not isinstance(
            modules.get(str(node.target)), nn.BatchNorm2d
        ):
            continue
        src = node.args[0] if node.args else None
        if not isinstance(src, torch.fx.Node) or src.op != "call_module" or len(src.users) != 1:
            continue
        conv, bn = modules.get(str(src.target)), modules[str(node.target)]
        if type(conv) is not nn.Conv2d or not bn.track_running_stats or bn.running_mean is None:
            continue
        if bn.training:
            raise ConfigError(
                f"fold_conv_bn: {node.target} is in training mode (the model says eval)"
            )
        if not hasattr(gm, FOLDED):
            gm.add_module(FOLDED, nn.Module())
            gm.register_load_state_dict_post_hook(_refold_all)
        name = str(src.target).replace(".", "_")
        getattr(gm, FOLDED).add_module(
            name, FoldedConv2d(conv, bn, str(src.target), str(node.target))
        )
        with gm.graph.inserting_before(src):
            new = gm.graph.call_module(f"{FOLDED}.{name}", src.args, src.kwargs)
        new.meta = dict(src.meta)
        node.replace_all_uses_with(new)
        gm.graph.erase_node(node)
        gm.graph.erase_node(src)
        folded += 1
    return PassResult(modified=folded > 0, detail=f"folded {plural(folded, 'conv+batchnorm pair')}")


PASS = PassSpec(name="fold_conv_bn", fn=fold_conv_bn, default=False)
"""This module's pass, listed with the other built-ins in :mod:`distopt.passes`."""
