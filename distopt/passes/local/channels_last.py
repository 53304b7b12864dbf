"""Run a conv net in channels-last (NHWC) layout: convert inputs at entry, restore outputs at exit.

oneDNN (CPU) and cuDNN convolutions are fastest in NHWC; once the input is channels-last,
convolutions, BatchNorm, ReLU, pooling and adds keep that layout, so one conversion at the graph's
entry moves the whole network. Outputs are converted back to the memory format the original
model returns (measured on the example inputs, else assumed contiguous), so callers see no change.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx
from torch import nn
from torch.utils._pytree import tree_flatten

from distopt.passes.core.base import PassContext, PassResult, PassSpec
from distopt.passes.local.fold_conv_bn import FoldedConv2d
from distopt.remote.registry import register_leaf_function
from distopt.text import plural
from distopt.verify import preserved_state

_FORMATS = {
    "channels_last": torch.channels_last,
    "contiguous_format": torch.contiguous_format,
}


@register_leaf_function
def to_channels_last(value: Any) -> Any:
    """NHWC copy of a 4-D floating-point tensor; anything else passes through."""
    if isinstance(value, torch.Tensor) and value.dim() == 4 and value.is_floating_point():
        return value.contiguous(memory_format=torch.channels_last)
    return value


@register_leaf_function
def restore_memory_format(value: Any, fmt: str) -> Any:
    """Give a 4-D output the layout the original model returned (``fmt`` names it)."""
    if isinstance(value, torch.Tensor) and value.dim() == 4:
        return value.contiguous(memory_format=_FORMATS[fmt])
    return value


def format_name(t: torch.Tensor) -> str:
    if (
        t.dim() == 4
        and not t.is_contiguous()
        and t.is_contiguous(memory_format=torch.channels_last)
    ):
        return "channels_last"
    return "contiguous_format"


def has_convolutions(gm: torch.fx.GraphModule) -> bool:
    modules = dict(gm.named_modules())
    for node in gm.graph.nodes:
        if node.op == "call_module" and isinstance(
            modules.get(str(node.target)), (nn.Conv2d, FoldedConv2d)
        ):
            return True
        if node.op == "call_function" and node.target in (torch.conv2d, torch.nn.functional.conv2d):
            return True
    return False


def _output_formats(
    gm: torch.fx.GraphModule, example_inputs: tuple[Any, ...] | None
) -> list[str] | None:
    """Memory format of every output leaf of the unmodified graph (None without inputs)."""
    if example_inputs is None:
        return None
    try:
        with preserved_state(gm), torch.no_grad(), torch.random.fork_rng(devices=[]):
            out = gm(*example_inputs)
    except Exception:
        return None
    leaves, _ = tree_flatten(out)
    return [format_name(v) if isinstance(v, torch.Tensor) else "contiguous_format" for v in leaves]


def channels_last(gm: torch.fx.GraphModule, ctx: PassContext) -> PassResult:
    """Convert 4-D inputs to channels-last at entry; restore outputs' original layout at exit.

    Before::

        conv1 = self.conv1(x);  ...;  return relu

    After::

        to_channels_last = distopt_passes_channels_last_to_channels_last(x)
        conv1 = self.conv1(to_channels_last);  ...
        restore_memory_format = ..._restore_memory_format(relu, 'contiguous_format')
        return restore_memory_format
    """
    if not has_convolutions(gm):
        return PassResult(modified=False, detail="no convolutions: layout unchanged")
    formats = _output_formats(gm, ctx.example_inputs)
    graph = gm.graph
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    converted = 0
    for ph in placeholders:
        if not ph.users:
            continue
        with graph.inserting_after(placeholders[-1]):
            node = graph.call_function(to_channels_last, (ph,))
        ph.replace_all_uses_with(node, delete_user_cb=lambda user, n=node: user is not n)
        converted += 1
    # Folded convolutions own their weights: store those channels-last too (no per-call reorder).
    for module in gm.modules():
        if isinstance(module, FoldedConv2d):
            module.weight = module.weight.contiguous(memory_format=torch.channels_last)
    output = next(n for n in reversed(graph.nodes) if n.op == "output")
    leaves, _ = tree_flatten(output.args[0])
    restored = 0
    for i, leaf in enumerate(leaves):
        if not isinstance(leaf, torch.fx.Node):
            continue
        fmt = formats[i] if formats is not None and i < len(formats) else "contiguous_format"
        with graph.inserting_before(output):
            node = graph.call_function(restore_memory_format, (leaf, fmt))
        output.replace_input_with(leaf, node)
        restored += 1
    return PassResult(
        modified=True,
        detail=f"channels-last: {plural(converted, 'input')} converted, {plural(restored, 'output')} restored",
    )


PASS = PassSpec(name="channels_last", fn=channels_last, default=False, after=("fold_conv_bn",))
"""This module's pass, listed with the other built-ins in :mod:`distopt.passes`."""
