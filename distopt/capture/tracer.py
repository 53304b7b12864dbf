"""The distopt symbolic tracer: configurable leaves, and registered remote calls as graph leaves."""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import inspect
import operator
import re
import sys
import types
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed.rpc as rpc_api
import torch.fx
from torch import nn
from torch.fx.proxy import TraceError

from distopt.capture.example_values import ExampleValues, NoExampleValue
from distopt.errors import ConfigError
from distopt.remote import rpc_calls
from distopt.remote.intercept import call_frame, intercepted
from distopt.remote.registry import constant_types
from distopt.where import caller_stack, user_frame_of


def resolve_qualname(qualname: str) -> Any:
    """Import ``pkg.mod.Name`` (or ``pkg.mod:Name``) and return the object."""
    module_name, _, attr = qualname.replace(":", ".").rpartition(".")
    if not module_name:
        raise ConfigError(f"{qualname!r}: expected a qualified name like 'package.module.Name'")
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError:
        # The name may be nested (pkg.mod.Class.method): import the longest module prefix.
        parts = qualname.replace(":", ".").split(".")
        for cut in range(len(parts) - 1, 0, -1):
            try:
                obj = importlib.import_module(".".join(parts[:cut]))
            except ImportError:
                continue
            for part in parts[cut:]:
                obj = getattr(obj, part, None)
                if obj is None:
                    break
            if obj is not None:
                return obj
        raise ConfigError(f"{qualname!r}: cannot import {module_name!r}") from None
    try:
        return getattr(obj, attr)
    except AttributeError:
        raise ConfigError(
            f"{qualname!r}: module {module_name!r} has no attribute {attr!r}"
        ) from None


def _looks_like_class(name: str) -> bool:
    """``pkg.mod.Class`` or ``pkg.mod:Class`` (a class to import), as opposed to a submodule path
    such as ``blocks.0`` (whose first part is no importable module)."""
    if ":" in name:
        return True
    head = name.split(".", 1)[0]
    return "." in name and importlib.util.find_spec(head) is not None


def check_leaves(
    model: nn.Module, leaf_modules: Iterable[str], leaf_functions: Iterable[str]
) -> None:
    """Every configured leaf names something real: one-line errors before tracing starts."""
    for leaf in leaf_modules:
        if _looks_like_class(leaf):
            try:
                obj = resolve_qualname(leaf)
            except ConfigError as err:
                raise ConfigError(f"capture.leaf_modules: {err}") from None
            if not isinstance(obj, type) or not issubclass(obj, nn.Module):
                raise ConfigError(f"capture.leaf_modules: {leaf!r} is not an nn.Module class")
            continue
        try:
            model.get_submodule(leaf)
        except AttributeError:
            raise ConfigError(
                f"capture.leaf_modules: {leaf!r} is neither a submodule of {type(model).__name__} "
                "nor an importable nn.Module class ('package.module.Class')"
            ) from None
    for fn in leaf_functions:
        try:
            obj = resolve_qualname(fn)
        except ConfigError as err:
            raise ConfigError(f"capture.leaf_functions: {err}") from None
        if not callable(obj):
            raise ConfigError(f"capture.leaf_functions: {fn!r} is not callable")


class DistoptTracer(torch.fx.Tracer):
    r"""``torch.fx.Tracer`` with user-chosen leaf modules/functions and remote calls kept as leaves.

    Every remote call the model's code makes (see :mod:`distopt.remote.intercept`) is recorded as
    one ``call_function`` node targeting the registered function, and never executed while
    tracing, even when none of its arguments is a traced value. RRefs, ``WorkerInfo`` objects and the
    functions passed to RPCs become attributes of the GraphModule.

    Given ``example_inputs`` (the forward's positional inputs), a branch on a traced value that
    fake tensors can compute (a shape, a dtype) is taken as the example takes it, and guarded:
    the graph gets a ``torch._assert`` that fails, quoting the user's line, for an input that
    would take the other branch. :attr:`guards` lists them.
    """

    def __init__(
        self,
        *,
        leaf_modules: Iterable[type[nn.Module] | str] = (),
        leaf_functions: Iterable[Callable[..., Any] | str] = (),
        example_inputs: tuple[Any, ...] | None = None,
    ) -> None:
        self._leaf_functions = tuple(
            resolve_qualname(f) if isinstance(f, str) else f for f in leaf_functions
        )
        super().__init__(autowrap_functions=self._leaf_functions)
        self.function_constants: dict[str, Callable[..., Any]] = {}
        self.function_constants_by_id: dict[int, str] = {}
        self.guards: list[str] = []
        """Each branch taken as the example inputs take it: ``file:line: `code` is True``."""
        self._example_inputs = example_inputs
        self._example_values: ExampleValues | None = None
        self._remote_nodes: set[torch.fx.Node] = set()
        self._leaf_types: tuple[type, ...] = ()
        self._leaf_paths: frozenset[str] = frozenset()
        types, paths = [], []
        for leaf in leaf_modules:
            if isinstance(leaf, type):
                types.append(leaf)
            elif _looks_like_class(leaf):
                obj = resolve_qualname(leaf)
                if not isinstance(obj, type) or not issubclass(obj, nn.Module):
                    raise ConfigError(f"leaf_modules: {leaf!r} is not an nn.Module class")
                types.append(obj)
            else:
                paths.append(str(leaf))  # a submodule path such as "blocks.0"
        self._leaf_types = tuple(types)
        self._leaf_paths = frozenset(paths)

    def create_arg(self, a: Any) -> Any:
        # Objects generated code cannot spell (functions passed to ``rpc_sync``, RRefs,
        # WorkerInfos, remote-module handles) become attributes of the GraphModule, read by
        # get_attr: the graph holds the object itself, never a copy.
        if isinstance(a, (types.FunctionType, types.BuiltinFunctionType)) and not isinstance(
            a, torch._ops.OpOverload
        ):
            return self._constant(a, getattr(a, "__name__", "fn"))
        if _is_opaque(a):
            return self._constant(a, type(a).__name__)
        if dataclasses.is_dataclass(a) and not isinstance(a, type):
            # Rebuilt by its class in the graph: FX would make transformers' ModelOutput (a
            # dataclass and a dict) a plain dict, and the user's ``output.logits`` would break.
            fields = {f.name: getattr(a, f.name) for f in dataclasses.fields(a) if f.init}
            return self.create_node("call_function", type(a), (), self.create_arg(fields))
        return super().create_arg(a)

    def _constant(self, value: Any, base: str) -> torch.fx.Node:
        name = self.function_constants_by_id.get(id(value))
        if name is None:
            base = re.sub(r"\W", "_", base).strip("_") or "obj"
            name = f"_distopt_const_{base}_{len(self.function_constants)}"
            self.function_constants[name] = value
            self.function_constants_by_id[id(value)] = name
        return self.create_node("get_attr", name, (), {})

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        if isinstance(m, self._leaf_types) or module_qualified_name in self._leaf_paths:
            return True
        if getattr(type(m), "_distopt_leaf", False):
            return True
        return super().is_leaf_module(m, module_qualified_name)

    def trace(
        self, root: nn.Module | Callable[..., Any], concrete_args: Any = None
    ) -> torch.fx.Graph:
        # Remote calls are recorded as leaves, never run: routed to _record on this thread.
        with intercepted(root, self._record):
            return super().trace(root, concrete_args)

    def create_args_for_root(
        self, root_fn: Callable[..., Any], is_module: bool, concrete_args: Any = None
    ) -> tuple[Any, list[Any]]:
        # With example inputs, the graph takes exactly those positional inputs, and the forward
        # is called as the user calls it: its other parameters keep their defaults, and a
        # decorator taking ``*args, **kwargs`` (transformers' models) sees real ones.
        if self._example_inputs is None or concrete_args is not None:
            return super().create_args_for_root(root_fn, is_module, concrete_args)
        positional = [
            p.name
            for p in inspect.signature(inspect.unwrap(root_fn)).parameters.values()
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
        ][1 if is_module else 0 :]
        if len(positional) < len(self._example_inputs):
            return super().create_args_for_root(root_fn, is_module, concrete_args)
        inputs = [
            self.create_proxy("placeholder", name, (), {})
            for name in positional[: len(self._example_inputs)]
        ]
        return root_fn, ([self.root] if is_module else []) + inputs

    def to_bool(self, obj: torch.fx.Proxy) -> bool:
        if self._example_inputs is None:
            return super().to_bool(obj)
        if self._example_values is None:
            self._example_values = ExampleValues(
                self.root,
                self.graph,
                self._example_inputs,
                self.function_constants,
                self._remote_nodes,
            )
        try:
            taken = bool(self._example_values.of(obj.node))
        except NoExampleValue as err:
            raise TraceError(
                f"symbolically traced variables cannot be used as inputs to control flow ({err})"
            ) from None
        except Exception as err:  # bool() of a fake tensor: the branch depends on the data
            raise TraceError(
                "symbolically traced variables cannot be used as inputs to control flow "
                f"(the branch depends on the data: {type(err).__name__})"
            ) from None
        # Proxy.__bool__ called us from the user's frame.
        frame = user_frame_of(sys._getframe(2))
        if frame is None:
            code, where = "a condition", "in the model"
        else:
            code, where = (frame.line or "").strip(), f"{frame.filename}:{frame.lineno}"
        condition = obj if taken else self.create_proxy("call_function", operator.not_, (obj,), {})
        message = (
            f"distopt: this graph was traced for inputs on which `{code}` ({where}) is {taken}; "
            f"this input makes it {not taken}: optimize the model again with such inputs, or "
            "call the original model"
        )
        self.create_proxy("call_function", torch._assert, (condition, message), {})
        self.guards.append(f"{where}: `{code}` is {taken}")
        return taken

    def _record(self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        proxy = self.create_proxy("call_function", fn, args, kwargs)
        self._remote_nodes.add(proxy.node)
        if not proxy.node.stack_trace:
            # The user's lines of the call (and of the helper that made it): waits quote them.
            proxy.node.stack_trace = caller_stack(call_frame(sys._getframe(1)))
        return proxy


def _is_opaque(value: Any) -> bool:
    """Values FX cannot put in generated code and that are not module state: remote handles."""
    if rpc_calls.is_rref(value) or isinstance(
        value, (rpc_api.WorkerInfo, rpc_calls.RemoteModuleHandle)
    ):
        return True
    return isinstance(value, constant_types())  # other libraries' handles (Ray actors, ObjectRefs)
