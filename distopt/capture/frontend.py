"""Capture a model into torch.fx IR: symbolic tracing, then Dynamo, then the untouched model."""

from __future__ import annotations

import copy
import enum
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx
from torch import nn

from distopt.capture.dynamo_remote import CapturedCall, polyfill_remote_calls
from distopt.capture.tracer import DistoptTracer, check_leaves
from distopt.config import CaptureConfig
from distopt.errors import ConfigError
from distopt.remote.intercept import makes_remote_calls
from distopt.remote.local import with_remote_calls
from distopt.remote.ops import remote_ops
from distopt.remote.record import CALL_INDEX
from distopt.where import describe_failure, user_frame

__all__ = [
    "CaptureResult",
    "Tier",
    "describe_failure",
    "dynamo_capture",
    "keep_state_names",
    "number_remote_calls",
    "symbolic_capture",
    "user_frame",
]


class Tier(str, enum.Enum):
    SYMBOLIC = "symbolic_trace"
    DYNAMO = "dynamo"
    EAGER = "eager_fallback"


@dataclass
class CaptureResult:
    tier: Tier
    module: nn.Module
    """A GraphModule (symbolic), a shallow copy with a compiled forward (dynamo) or the original."""
    reason: str | None = None
    """Why the symbolic tier was not used, with the user's source line when known."""


def number_remote_calls(gm: torch.fx.GraphModule) -> int:
    """Write :data:`CALL_INDEX` on every remote call and issue of a freshly captured graph."""
    count = 0
    for node, op in remote_ops(gm.graph).items():
        if node is op.start:
            node.meta[CALL_INDEX] = count
            count += 1
    return count


def symbolic_capture(
    model: nn.Module, config: CaptureConfig, example_inputs: tuple[Any, ...] | None = None
) -> torch.fx.GraphModule:
    """Tier 1: trace with :class:`DistoptTracer`; keep every parameter and buffer name of ``model``.

    With ``example_inputs``, branches on shapes are taken as the inputs take them, each guarded
    in the graph; ``gm.meta["distopt_guards"]`` lists them (:class:`DistoptTracer`).

    A model holding ``RemoteModule`` is traced through a view in which each is a local
    stand-in making one remote call (:func:`distopt.remote.local.with_remote_calls`); the result
    then holds only the local state.
    """
    check_leaves(model, config.leaf_modules, config.leaf_functions)
    view = with_remote_calls(model)
    tracer = DistoptTracer(leaf_modules=config.leaf_modules, leaf_functions=config.leaf_functions)
    try:
        graph = tracer.trace(view)
    except ConfigError:
        raise
    except Exception:
        if example_inputs is None:
            raise
        # Traced again, branches on shapes taken as the example inputs take them (guarded).
        # A model that traces without them keeps the graph it always had.
        tracer = DistoptTracer(
            leaf_modules=config.leaf_modules,
            leaf_functions=config.leaf_functions,
            example_inputs=example_inputs,
        )
        graph = tracer.trace(view)
    root = tracer.root
    if tracer.function_constants:
        # A shallow view (shared parameters and submodules) carries the function constants,
        # so the user's module never gains attributes.
        root = copy.copy(root)
        root.__dict__.update(tracer.function_constants)
    gm = torch.fx.GraphModule(root, graph, type(model).__name__)
    keep_state_names(view, gm)
    gm.meta["distopt_original_class"] = type(model).__qualname__
    gm.meta["distopt_guards"] = list(tracer.guards)
    number_remote_calls(gm)
    return gm


def keep_state_names(original: nn.Module, gm: torch.fx.GraphModule) -> None:
    """Re-attach parameters/buffers the forward never touches so ``state_dict`` keys match.

    GraphModule copies only the attributes the graph references; a checkpoint of the optimized
    model must still load into the original model and vice versa.
    """
    have = set(gm.state_dict().keys())
    for key, value in original.state_dict(keep_vars=True).items():
        if key in have:
            continue
        owner_path, _, attr = key.rpartition(".")
        src_owner = original.get_submodule(owner_path) if owner_path else original
        dst_owner: nn.Module = gm
        for part in owner_path.split(".") if owner_path else []:
            if not hasattr(dst_owner, part):
                dst_owner.add_module(part, nn.Module())
            dst_owner = getattr(dst_owner, part)
        if attr in src_owner._parameters:
            dst_owner.register_parameter(attr, src_owner._parameters[attr])
        else:
            persistent = attr not in getattr(src_owner, "_non_persistent_buffers_set", set())
            dst_owner.register_buffer(attr, value, persistent=persistent)
    # Order keys like the original so checkpoints diff cleanly.
    if list(gm.state_dict().keys()) != list(original.state_dict().keys()):
        _reorder_like(original, gm)


def _reorder_like(original: nn.Module, gm: nn.Module) -> None:
    order = [name for name, _ in original.named_children()]
    children = dict(gm._modules)
    gm._modules.clear()
    for name in order:
        if name in children:
            gm._modules[name] = children.pop(name)
    gm._modules.update(children)
    for name, child in gm._modules.items():
        if child is not None and hasattr(original, name):
            orig_child = getattr(original, name)
            if isinstance(orig_child, nn.Module):
                _reorder_like(orig_child, child)
    for registry_name in ("_parameters", "_buffers"):
        ours = getattr(gm, registry_name)
        theirs = getattr(original, registry_name)
        items = dict(ours)
        ours.clear()
        for key in theirs:
            if key in items:
                ours[key] = items.pop(key)
        ours.update(items)


def dynamo_capture(model: nn.Module, backend: Callable[..., Callable[..., object]]) -> nn.Module:
    """Tier 2: a shallow copy of ``model`` whose calls run through ``torch.compile(backend=...)``.

    The copy shares parameters, buffers and submodules with ``model`` (same ``state_dict`` keys,
    no ``_orig_mod.`` prefix) while the user's module itself stays uncompiled. A model that makes
    remote calls gets them as graph nodes (:mod:`distopt.capture.dynamo_remote`), its
    ``RemoteModule`` objects as local stand-ins. Calls go through a
    :class:`~distopt.capture.dynamo_remote.CapturedCall`, which never lets a Dynamo failure break
    the module.
    """
    view = with_remote_calls(model)
    clone = copy.copy(view)
    # Called through nn.Module: some libraries define their own ``compile`` (Keras-style).
    nn.Module.compile(clone, backend=backend, dynamic=False)
    learns = makes_remote_calls(view)
    if learns:
        polyfill_remote_calls()
    assert clone._compiled_call_impl is not None
    clone._compiled_call_impl = CapturedCall(clone._compiled_call_impl, clone, learns=learns)
    return clone
