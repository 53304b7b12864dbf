"""The distopt symbolic tracer: configurable leaves, and registered remote calls as graph leaves."""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import sys
import traceback
import types
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
import torch.fx
from torch import nn

from distopt.errors import ConfigError
from distopt.remote import registry


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
        raise ConfigError(f"{qualname!r}: module {module_name!r} has no attribute {attr!r}") from None


def _looks_like_class(name: str) -> bool:
    """``pkg.mod.Class`` or ``pkg.mod:Class`` (a class to import), as opposed to a submodule path
    such as ``blocks.0`` (whose first part is no importable module)."""
    if ":" in name:
        return True
    head = name.split(".", 1)[0]
    return "." in name and importlib.util.find_spec(head) is not None


def check_leaves(model: nn.Module, leaf_modules: Iterable[str], leaf_functions: Iterable[str]) -> None:
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
    """``torch.fx.Tracer`` with user-chosen leaf modules/functions and remote calls kept as leaves.

    A registered remote call (see :mod:`distopt.remote`) is replaced, for the duration of a trace, by
    a stub that records a ``call_function`` node targeting the real function — so the call is never
    executed while tracing, even when none of its arguments is a traced value.
    """

    def __init__(
        self,
        *,
        leaf_modules: Iterable[type[nn.Module] | str] = (),
        leaf_functions: Iterable[Callable[..., Any] | str] = (),
    ) -> None:
        self._leaf_functions = tuple(
            resolve_qualname(f) if isinstance(f, str) else f for f in leaf_functions
        )
        super().__init__(autowrap_functions=self._leaf_functions)
        self.function_constants: dict[str, Callable[..., Any]] = {}
        self.function_constants_by_id: dict[int, str] = {}
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
        # Functions passed as arguments (``rpc_sync(to, fetch_rows, args=...)``) cannot be written
        # into generated code, so they become attributes of the GraphModule read by get_attr.
        if isinstance(a, (types.FunctionType, types.BuiltinFunctionType)) and not isinstance(
            a, torch._ops.OpOverload
        ):
            name = self.function_constants_by_id.get(id(a))
            if name is None:
                base = getattr(a, "__name__", "fn").strip("<>") or "fn"
                name = f"_distopt_fn_{base}_{len(self.function_constants)}"
                self.function_constants[name] = a
                self.function_constants_by_id[id(a)] = name
            return self.create_node("get_attr", name, (), {})
        return super().create_arg(a)

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        if isinstance(m, self._leaf_types) or module_qualified_name in self._leaf_paths:
            return True
        if getattr(type(m), "_distopt_leaf", False):
            return True
        return super().is_leaf_module(m, module_qualified_name)

    def trace(self, root: nn.Module | Callable[..., Any], concrete_args: Any = None) -> torch.fx.Graph:
        with self._remote_calls_as_leaves(root):
            return super().trace(root, concrete_args)

    @contextlib.contextmanager
    def _remote_calls_as_leaves(self, root: Any) -> Iterator[None]:
        leaves = {id(fn): fn for fn in registry.leaf_callables()}
        aliases = [a for spec in registry.registered_specs() for a in spec.aliases]
        namespaces = _namespaces_to_patch(root)
        patched: list[tuple[dict[str, Any], str, Any]] = []
        try:
            places = [(ns, name) for ns in namespaces for name, v in list(ns.items()) if id(v) in leaves]
            places += [(ns, name) for ns, name in aliases if id(ns.get(name)) in leaves]
            for ns, name in places:
                original = ns[name]
                patched.append((ns, name, original))
                ns[name] = self._make_stub(original)
            yield
        finally:
            for ns, name, original in reversed(patched):
                ns[name] = original

    def _make_stub(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        tracer = self

        def remote_call_stub(*args: Any, **kwargs: Any) -> Any:
            proxy = tracer.create_proxy("call_function", fn, args, kwargs)
            if not proxy.node.stack_trace:
                # The user's line of the call: errors raised at its wait quote it.
                proxy.node.stack_trace = "".join(traceback.format_stack(sys._getframe(1), limit=1))
            return proxy

        remote_call_stub.__wrapped__ = fn  # type: ignore[attr-defined]
        return remote_call_stub


def _namespaces_to_patch(root: Any) -> list[dict[str, Any]]:
    """Globals of every module whose code the trace may run: the root's and its submodules' classes."""
    seen: set[int] = set()
    result: list[dict[str, Any]] = []

    def add(module_name: str | None) -> None:
        mod = sys.modules.get(module_name or "")
        if mod is not None and id(mod) not in seen:
            seen.add(id(mod))
            result.append(vars(mod))

    if isinstance(root, nn.Module):
        for sub in root.modules():
            if isinstance(sub, torch.fx.GraphModule):
                # Generated code keeps its own globals: re-tracing must patch those too.
                generated = type(sub).forward.__globals__
                if id(generated) not in seen:
                    seen.add(id(generated))
                    result.append(generated)
            for cls in type(sub).__mro__:
                if cls.__module__.startswith("torch."):
                    break
                add(cls.__module__)
    else:
        add(getattr(root, "__module__", None))
    for fn in registry.leaf_callables():
        add(getattr(fn, "__module__", None))
    return result
