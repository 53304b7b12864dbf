"""Regional compilation: find a model's repeated blocks and compile each of them in place.

torch.compile's regional compilation recipe compiles the repeated layer of a model
(``for layer in model.layers: layer.compile()``) instead of the whole model: layers of one class
share their ``forward`` code, and with their parameters passed to the compiled graph as inputs
(``inline_inbuilt_nn_modules``, the default since torch 2.5) Dynamo compiles a block once and
reuses it for every block with the same structure and shapes. Compile time then grows with the
number of *distinct* blocks, not with depth. :func:`distopt.parallelize` does this when asked to
compile (``compile=True``, ``compile_regions=True``); the parts outside the blocks are compiled
per FSDP unit, or stay eager under DDP.

A region is a block (a module with submodules, not a single layer) in a ``ModuleList``/
``Sequential`` in which at least two blocks are structurally identical (same class, same
``repr``, same state shapes). The outermost such level is taken: GPT's ``blocks.N``; in a ResNet or ConvNeXt, whose
stages differ, the layers inside each stage.
"""

from __future__ import annotations

import collections
import functools
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch._dynamo
from torch import nn

from distopt.remote.intercept import makes_remote_calls


def structure(module: nn.Module) -> tuple[Any, ...]:
    """What must agree for two blocks to share one compiled region (shapes still guard reuse)."""
    state = tuple(
        (k, tuple(v.shape), v.dtype) for k, v in module.state_dict(keep_vars=True).items()
    )
    return (type(module).__qualname__, repr(module), state)


def repeated_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The model's regions (module docstring), as ``(path, module)`` in module order."""
    return _regions(model, "")


def _regions(module: nn.Module, prefix: str) -> list[tuple[str, nn.Module]]:
    children = list(module.named_children())
    if isinstance(module, (nn.ModuleList, nn.Sequential)) and len(children) >= 2:
        counts = collections.Counter(structure(child) for _, child in children)
        blocks = [(name, child) for name, child in children if any(True for _ in child.children())]
        if any(counts[structure(child)] >= 2 for _, child in blocks):
            return [(f"{prefix}{name}", child) for name, child in blocks]
    found: list[tuple[str, nn.Module]] = []
    for name, child in children:
        found += _regions(child, f"{prefix}{name}.")
    return found


def path_ranges(paths: Iterable[str]) -> str:
    """``layers.0``…``layers.3`` and ``head`` as ``layers.0-3, head``: consecutive numbered
    siblings as one range, in order."""
    spans: list[tuple[str, int, int] | str] = []  # (parent, first, last), or a path as it is
    for path in paths:
        parent, _, last = path.rpartition(".")
        if not last.isdigit():
            spans.append(path)
            continue
        index = int(last)
        previous = spans[-1] if spans else None
        if isinstance(previous, tuple) and previous[0] == parent and previous[2] == index - 1:
            spans[-1] = (parent, previous[1], index)
        else:
            spans.append((parent, index, index))
    return ", ".join(span if isinstance(span, str) else _range_text(*span) for span in spans)


def _range_text(parent: str, first: int, last: int) -> str:
    prefix = f"{parent}." if parent else ""
    return f"{prefix}{first}" + (f"-{last}" if last != first else "")


def compilable_regions(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """:func:`repeated_blocks`, or none when a block makes remote calls (the graph passes must
    see those, so blocks cannot be traced as single nodes)."""
    regions = repeated_blocks(model)
    if any(makes_remote_calls(block) for _, block in regions):
        return []
    return regions


def compile_regions(regions: Iterable[nn.Module], *, backend: Any = "inductor") -> int:
    """``torch.compile`` each region in place (``nn.Module.compile``), each as one graph of static
    shapes; returns how many.

    Static: blocks of one class share their ``forward`` code, and so Dynamo's cache entries. When
    distinct blocks of one class take inputs of other shapes (a conv net's stages: ConvNeXt-T's
    layers of widths 96 to 768 on 16² to 2² pixels), the default ``dynamic=None`` takes the
    second shape for a dynamic one and compiles every later block with symbolic sizes: kernels
    that are slower to build and to run. Each distinct block is compiled for its own shapes.

    Under DDP, Dynamo's DDPOptimizer splits a graph it compiles inside DDP's forward at DDP's
    bucket boundaries, so that a whole-model graph's backward lets DDP all-reduce the first
    buckets while the rest computes. A region's backward is already a graph of its own, done when
    its gradients are: a split inside it only adds graphs to compile (GPT's 27 MiB block became
    two forward and two backward graphs with DDP's 25 MiB buckets). So a region is compiled with
    ``optimize_ddp`` off, for its own calls only.
    """
    count = 0
    for block in regions:
        # What nn.Module.compile does, with the region's calls under the patch.
        compiled = torch.compile(block._call_impl, backend=backend, dynamic=False)
        block._compiled_call_impl = _one_graph(compiled)
        count += 1
    return count


def _one_graph(compiled: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(compiled)
    def call(*args: Any, **kwargs: Any) -> Any:
        with torch._dynamo.config.patch(optimize_ddp=False):
            return compiled(*args, **kwargs)

    return call
