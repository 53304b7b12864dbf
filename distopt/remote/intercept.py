"""Route the remote calls a model's code makes to a handler, for the duration of a ``with`` block.

Tracing records each call as a graph node instead of running it; verification runs it once and
records its result. Both need the same thing: every place the model's code can reach a registered
remote function (or another leaf: an issue, a wait helper) answers with a wrapper. The places are
the globals of the modules the model's code lives in (its classes', their helpers'), the aliases
the registry knows (``torch.distributed.rpc.rpc_sync``), and ``RRefProxy``'s ``_invoke_rpc``
(``rref.rpc_sync().forward(x)``), which is rewritten to :func:`~distopt.remote.rpc_calls.rref_call`.

Only the thread that entered the block is routed: a parameter-server heartbeat thread calling
``rpc.rpc_async`` meanwhile gets the original function.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import types
from collections.abc import Callable, Iterator
from typing import Any

from torch import nn

from distopt.remote import registry, rpc_calls
from distopt.remote.helpers import declare_helpers
from distopt.remote.local import RemoteModuleCall, local_modules

Handler = Callable[[Callable[..., Any], tuple[Any, ...], dict[str, Any]], Any]
"""``handler(fn, args, kwargs)``: what a routed call returns instead of ``fn(*args, **kwargs)``.
A handler that runs the call for real does it inside :func:`calling_through`."""

_STATE = threading.local()


@contextlib.contextmanager
def calling_through() -> Iterator[None]:
    """Inside, routed names call their originals: the calls a remote call makes itself (a
    ``RemoteModule``'s ``rpc_async``, ``rref_call``'s ``RRefProxy``) are part of it."""
    before = getattr(_STATE, "through", False)
    _STATE.through = True
    try:
        yield
    finally:
        _STATE.through = before


@contextlib.contextmanager
def intercepted(root: Any, handler: Handler) -> Iterator[None]:
    """Route this thread's calls of leaf callables reachable from ``root``'s code to ``handler``.

    Helpers in that code that wrap a blocking RPC are declared remote calls first
    (:mod:`distopt.remote.helpers`), so they are routed as one call.
    """
    registry.install_imported()  # Ray's calls, once the model's code has imported Ray
    namespaces = namespaces_of(root)
    declare_helpers(namespaces)
    leaves = {id(fn): fn for fn in registry.leaf_callables()}
    places = [(ns, name) for ns in namespaces for name, v in list(ns.items()) if id(v) in leaves]
    places += [(ns, name) for ns, name in registry.leaf_aliases() if id(ns.get(name)) in leaves]
    places.append((rpc_calls.RREF_PROXY_NAMESPACE, "_invoke_rpc"))
    thread = threading.get_ident()
    patched: list[tuple[dict[str, Any], str, Any]] = []
    methods: list[tuple[type, str, Any]] = []
    try:
        seen: set[tuple[int, str]] = set()
        for ns, name in places:
            if (id(ns), name) in seen:
                continue
            seen.add((id(ns), name))
            original = ns[name]
            patched.append((ns, name, original))
            ns[name] = _route(original, handler, thread, proxy=name == "_invoke_rpc")
        for owner, name, canonical in registry.routed_methods():
            method = owner.__dict__[name]
            methods.append((owner, name, method))
            setattr(owner, name, _route_method(owner, method, canonical, handler, thread))
        yield
    finally:
        for ns, name, original in reversed(patched):
            ns[name] = original
        for owner, name, method in reversed(methods):
            setattr(owner, name, method)


def makes_remote_calls(root: Any) -> bool:
    """Whether ``root``'s code can reach a registered remote function (declaring the RPC helpers
    it uses on the way)."""
    registry.install_imported()
    namespaces = namespaces_of(root, with_leaf_modules=False)
    declare_helpers(namespaces)
    if any(isinstance(m, RemoteModuleCall) for m in local_modules(root)):
        return True
    specs = registry.registered_specs()
    remote = {id(spec.fn) for spec in specs} | {id(spec.issue) for spec in specs}
    aliased = {id(ns) for ns, _ in registry.leaf_aliases()}  # e.g. torch.distributed.rpc itself
    for ns in namespaces:
        values = list(ns.values())
        if any(id(v) in remote for v in values):
            return True
        # ``rpc.rpc_sync(...)`` reaches rpc_sync through the module object.
        if any(isinstance(v, types.ModuleType) and id(vars(v)) in aliased for v in values):
            return True
    return False


def _route(
    fn: Callable[..., Any], handler: Handler, thread: int, *, proxy: bool
) -> Callable[..., Any]:
    def routed(*args: Any, **kwargs: Any) -> Any:
        if threading.get_ident() != thread or getattr(_STATE, "through", False):
            return fn(*args, **kwargs)
        if proxy:  # RRefProxy: _invoke_rpc(rref, rpc_api, method, timeout, *args, **kwargs)
            canonical, call_args = rpc_calls.rref_proxy_call(*args, **kwargs)
            return handler(canonical, call_args, {})
        return handler(fn, args, kwargs)

    routed.__wrapped__ = fn  # type: ignore[attr-defined]
    routed._distopt_routed = fn  # type: ignore[attr-defined]
    return routed


def call_frame(default: types.FrameType) -> types.FrameType:
    """The frame of the user's call being routed: ``default``, the caller of a routed function,
    unless a routed method found it outside its library's frames."""
    return getattr(_STATE, "frame", None) or default


def _route_method(
    owner: type,
    method: Callable[..., Any],
    canonical: Callable[..., Any],
    handler: Handler,
    thread: int,
) -> Callable[..., Any]:
    """A method of a library class (Ray's ``ActorMethod._remote``) routed as the call ``canonical``
    names; class attributes, so patched on the class rather than in a namespace."""

    def routed(self: Any, *args: Any, **kwargs: Any) -> Any:
        if threading.get_ident() != thread or getattr(_STATE, "through", False):
            return method(self, *args, **kwargs)
        fn, call_args = canonical(self, *args, **kwargs)
        # The user's call is the frame outside the library's own (``ActorMethod.remote``).
        frame = sys._getframe(1)
        library = owner.__module__.split(".")[0] + "."
        while frame.f_back is not None and frame.f_globals.get("__name__", "").startswith(library):
            frame = frame.f_back
        _STATE.frame = frame
        try:
            return handler(fn, call_args, {})
        finally:
            _STATE.frame = None

    routed.__wrapped__ = method  # type: ignore[attr-defined]
    return routed


def namespaces_of(root: Any, *, with_leaf_modules: bool = True) -> list[dict[str, Any]]:
    """Globals of every module whose code running ``root`` may execute.

    The modules of the root's and its submodules' classes (for a GraphModule, its generated
    code's globals too), the modules of the functions those globals name (helpers imported from
    elsewhere, such as the RPC tutorials' ``_remote_method``), and the modules of the registered
    leaf callables.
    """
    seen: set[int] = set()
    result: list[dict[str, Any]] = []

    def add(namespace: dict[str, Any] | None) -> None:
        if namespace is not None and id(namespace) not in seen:
            seen.add(id(namespace))
            result.append(namespace)

    def add_module(name: str | None) -> None:
        module = sys.modules.get(name or "")
        add(vars(module) if module is not None else None)

    if isinstance(root, nn.Module):
        for sub in local_modules(root):
            forward = getattr(type(sub), "forward", None)
            if isinstance(forward, types.FunctionType):
                add(forward.__globals__)  # generated GraphModule code keeps its own globals
            for cls in type(sub).__mro__:
                if cls.__module__.startswith("torch."):
                    break
                add_module(cls.__module__)
    else:
        add_module(getattr(root, "__module__", None))
    for namespace in list(result):
        for value in list(namespace.values()):
            if isinstance(value, types.FunctionType) and not (value.__module__ or "").startswith(
                "torch."
            ):
                add(value.__globals__)
    for fn in registry.leaf_callables() if with_leaf_modules else ():
        add_module(getattr(fn, "__module__", None))
    return result
