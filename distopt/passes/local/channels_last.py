"""Run a conv net in channels-last (NHWC) layout: convert inputs at entry, restore outputs at exit.

oneDNN (CPU) and cuDNN convolutions are often fastest in NHWC; once the input is channels-last,
convolutions, BatchNorm, ReLU, pooling and adds keep that layout, so one conversion at the graph's
entry moves the whole network. Outputs are converted back to the memory format the original
model returns (measured on the example inputs, else assumed contiguous), so callers see no change.

Whether NHWC wins depends on the machine and the shapes (a small net can lose more to the
conversions than it gains), so the pass keeps the layout only where it measured faster
(:func:`~distopt.passes.local.measured.keep_if_faster`). Parameters stay as they are: in a
Dynamo graph they are placeholders too, and only the model's inputs are converted.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.fx
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._pytree import tree_flatten, tree_map, tree_map_only

from distopt.passes.core.pass_base import PassContext, PassResult, PassSpec
from distopt.passes.core.runner import REORDERS_FLOAT
from distopt.passes.local.measured import CONTAINER, keep_if_faster
from distopt.passes.local.patterns import is_convolution
from distopt.remote.isolation import forked_rng, preserved_state
from distopt.remote.registry import register_leaf_function
from distopt.text import plural

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


def run_channels_last(module: nn.Module) -> None:
    """The same conversions for a module without a graph, as forward hooks: 4-D inputs to
    channels-last before its forward, 4-D outputs back to contiguous after it.

    For a model :func:`distopt.parallelize` compiles without the graph distopt captured (Dynamo
    captured it, and the compiled regions or the whole-model compile replace that capture).
    """
    module.register_forward_pre_hook(lambda _, args: tuple(to_channels_last(a) for a in args))
    module.register_forward_hook(
        lambda _, args, out: tree_map(lambda v: restore_memory_format(v, "contiguous_format"), out)
    )


def has_convolutions(gm: torch.fx.GraphModule) -> bool:
    return any(is_convolution(gm, node) for node in gm.graph.nodes)


def is_converted(gm: torch.fx.GraphModule) -> bool:
    """The graph already converts its inputs to channels-last (this pass or mkldnn_fusion ran)."""
    return any(n.op == "call_function" and n.target is to_channels_last for n in gm.graph.nodes)


def _is_model_state(node: torch.fx.Node) -> bool:
    """A Dynamo placeholder that carries a parameter or buffer, not a model input."""
    source = getattr(node.meta.get("grapharg"), "source", None)
    name = str(getattr(source, "name", ""))
    return "._parameters[" in name or "._buffers[" in name


def output_formats(
    gm: torch.fx.GraphModule, example_inputs: tuple[Any, ...] | None
) -> list[str] | None:
    """Memory format of every output leaf of the unmodified graph: from Dynamo's metadata when the
    graph has it, else from a run on fake copies of the example inputs (strides, no data: a
    symbolically traced ConvNeXt-T at one thread ran a second for this), else from a real run
    (None without inputs)."""
    output = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    leaves, _ = tree_flatten(output.args[0])
    values = [
        leaf.meta.get("example_value") if isinstance(leaf, torch.fx.Node) else None
        for leaf in leaves
    ]
    tensors = [v for v in values if isinstance(v, torch.Tensor)]
    if tensors and len(tensors) == len(values):
        return [format_name(v) for v in tensors]
    if example_inputs is None:
        return None
    out = _fake_run(gm, example_inputs)
    if out is None:
        try:
            with preserved_state(gm), torch.no_grad(), forked_rng():
                out = gm(*example_inputs)
        except Exception:
            return None
    leaves, _ = tree_flatten(out)
    return [format_name(v) if isinstance(v, torch.Tensor) else "contiguous_format" for v in leaves]


def _fake_run(gm: torch.fx.GraphModule, example_inputs: tuple[Any, ...]) -> Any:
    """``gm``'s outputs on fake copies of ``example_inputs``; None when an op has no fake kernel
    (the model's state, real, turns fake where an op meets it, and is never written). A graph
    holding fused modules runs as a copy: they cache the weights they derive, which a fake call
    would fill with fakes."""
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    try:
        if hasattr(gm, CONTAINER):
            gm = copy.deepcopy(gm)
        inputs = tree_map_only(torch.Tensor, mode.from_tensor, example_inputs)
        with preserved_state(gm), torch.no_grad(), mode:
            return gm(*inputs)
    except Exception:
        return None


def convert_layout(
    gm: torch.fx.GraphModule, ctx: PassContext, formats: list[str] | None = None
) -> tuple[int, int]:
    """Insert the conversions: inputs to channels-last at entry, outputs to their original layout
    (``formats``, from :func:`output_formats` of the graph before any rewrite; found now when
    not given) at exit. Returns how many inputs were converted and outputs restored."""
    if formats is None:
        formats = output_formats(gm, ctx.example_inputs)
    graph = gm.graph
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    converted = 0
    for ph in placeholders:
        if not ph.users or _is_model_state(ph):
            continue
        with graph.inserting_after(placeholders[-1]):
            node = graph.call_function(to_channels_last, (ph,))
        node.meta[REORDERS_FLOAT] = True
        ph.replace_all_uses_with(node, delete_user_cb=lambda user, n=node: user is not n)
        converted += 1
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
    return converted, restored


def channels_last(gm: torch.fx.GraphModule, ctx: PassContext) -> PassResult:
    """Convert 4-D inputs to channels-last at entry; restore outputs' original layout at exit.

    Kept only where it measured faster (module docstring).

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
    if is_converted(gm):
        return PassResult(modified=False, detail="inputs already converted to channels-last")

    def rewrite(gm: torch.fx.GraphModule) -> tuple[bool, str]:
        converted, restored = convert_layout(gm, ctx)
        return (
            converted > 0,
            f"channels-last: {plural(converted, 'input')} converted, {plural(restored, 'output')} restored",
        )

    return keep_if_faster(gm, ctx, rewrite)


PASS = PassSpec(
    name="channels_last", fn=channels_last, after=("fold_conv_bn",), options=("measure",)
)
"""This module's pass, listed with the other built-ins in :mod:`distopt.passes`."""
