"""Ray's remote calls as users write them, declared to the registry.

==============================================  ==================================================
user code                                       graph
==============================================  ==================================================
``handle.lookup.remote(ids)``                   issue :func:`ray_remote` ``(handle, "lookup",
(also ``.options(...).remote(...)``)            (ids,), {}, options)``, an ``ObjectRef``
``fn.remote(ref, ids)`` (a ``@ray.remote``      :func:`ray_remote` ``(fn, None, (ref, ids), {},
function)                                       options)``
``ray.get(ref)``                                left as written; ``pair_user_waits`` turns it into
                                                the wait op when ``ref`` is such an issue
==============================================  ==================================================

So ``ray.get(handle.lookup.remote(ids))`` in a forward becomes an issue plus a wait, which
``hoist_issue`` moves up and ``sink_wait`` down, like ``rpc_sync``. While a model is traced or
recorded, ``ActorMethod._remote`` and ``RemoteFunction._remote`` are routed (every ``.remote``
reaches them), and ``ActorHandle``, ``RemoteFunction`` and ``ObjectRef`` objects become
GraphModule attributes.

**Resource**: a call on an actor touches that actor; a task touches unknown state (it conflicts
with every write). **Effect**: ``distopt.register_read`` on the method, as written on the class
(``register_read(EmbeddingServer.lookup)``, the ``@ray.remote`` class or the plain one), or on
the ``@ray.remote`` function; anything else is a write. **Batching**: :func:`register_batched`
names a method (or task) serving several calls in one request; ``batch_fetch`` then merges
concurrent reads of one actor (or task).

distopt never imports Ray: the declarations are made with the ``ray`` module the model's code
imported (:func:`~distopt.remote.registry.register_on_import`), and a call of a Ray object finds
Ray in ``sys.modules`` (no model holds one without having imported Ray). distopt imports without
Ray installed.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable, Hashable, Mapping, Sequence
from types import ModuleType
from typing import Any, cast

import torch.fx

from distopt.errors import ConfigError
from distopt.remote.registry import (
    Effect,
    declared_effect,
    register_constant_type,
    register_on_import,
    register_remote,
    register_routed_method,
)

_BATCHED: dict[int, Any] = {}
"""``id`` of a method's function (or of a remote function) → its batched variant."""

_CANONICAL: dict[str, Callable[..., Any]] = {}
"""The issue function, bound when installed: while a model is traced this module's global names
of leaf functions answer with routing wrappers, so they are never looked up at call time."""


# --------------------------------------------------------------------------- canonical calls


def ray_remote(
    target: Any,
    method: str | None,
    args: Sequence[Any] = (),
    kwargs: Mapping[str, Any] | None = None,
    options: Mapping[str, Any] | None = None,
) -> Any:
    """``target.method.remote(*args, **kwargs)`` for an actor handle, ``target.remote(...)`` for a
    remote function (``method`` is ``None``), with ``.options(**options)`` when given: an
    ``ObjectRef``."""
    call = target if method is None else getattr(target, method)
    if options:
        call = call.options(**options)
    return call.remote(*args, **(kwargs or {}))


def ray_call(
    target: Any,
    method: str | None,
    args: Sequence[Any] = (),
    kwargs: Mapping[str, Any] | None = None,
    options: Mapping[str, Any] | None = None,
) -> Any:
    """``ray.get(ray_remote(...))``: the blocking form the spec is named after."""
    ray = sys.modules["ray"]  # ``target`` is a Ray object: the model's code has imported Ray
    return ray.get(ray_remote(target, method, args, kwargs, options))


def ray_remote_many(
    arg_lists: Sequence[Sequence[Any]], kwarg_lists: Sequence[Mapping[str, Any]]
) -> Any:
    """One request for several calls of one actor method (or task) with a batched variant: the
    variant receives the calls' argument tuples and returns their results in order."""
    target, method = arg_lists[0][0], arg_lists[0][1]
    calls = [tuple(a[2]) for a in arg_lists]
    variant = _batched_variant(target, method)
    if variant is None:
        raise ConfigError(f"ray_remote_many: {method or target!r} has no batched variant")
    if method is None:
        return variant.remote(calls)
    return getattr(target, variant).remote(calls)


# --------------------------------------------------------------------------- effects, resources


def _actor_class(handle: Any) -> Any | None:
    """The ``@ray.remote`` class an actor handle was made from (by its creation descriptor)."""
    descriptor = getattr(handle, "_ray_actor_creation_function_descriptor", None)
    if descriptor is None:
        return None
    for module_name in (descriptor.module_name, "__main__"):
        owner: Any = sys.modules.get(module_name)
        for part in descriptor.class_name.split("."):
            owner = getattr(owner, part, None)
        if owner is not None:
            return owner
    return None


def _method_functions(handle: Any, method: str) -> list[Any]:
    """Where a declaration about ``handle.method`` may be stored: the method as the ``@ray.remote``
    class gives it, what it wraps, and the method of the plain class."""
    cls = _actor_class(handle)
    found = []
    for owner in (cls, getattr(cls, "__ray_actor_class__", None)):
        fn = getattr(owner, method, None) if owner is not None else None
        if fn is not None:
            fn = getattr(fn, "__func__", fn)
            found += [fn, inspect.unwrap(fn)]
    return found


def _target_functions(target: Any, method: str | None) -> list[Any]:
    if method is not None:
        return _method_functions(target, method)
    return [target, getattr(target, "_function", None)]


def _parts(args: Sequence[Any], kwargs: Mapping[str, Any]) -> tuple[Any, Any, Any, Any, Any]:
    names = ("target", "method", "args", "kwargs", "options")
    values = [*args, *(kwargs.get(n) for n in names[len(args) :])]
    return values[0], values[1], values[2] or (), values[3] or {}, values[4] or {}


def ray_effect(args: Sequence[Any], kwargs: Mapping[str, Any]) -> Effect:
    target, method, *_ = _parts(args, kwargs)
    for fn in _target_functions(target, method if isinstance(method, str) else None):
        declared = declared_effect(fn) if fn is not None else None
        if declared is not None:
            return declared
    return "write"


def ray_runs(args: Sequence[Any], kwargs: Mapping[str, Any]) -> list[Any]:
    """The actor method (or task) a call runs, where its declaration is looked for."""
    target, method, *_ = _parts(args, kwargs)
    found = [
        fn
        for fn in _target_functions(target, method if isinstance(method, str) else None)
        if fn is not None
    ]
    return found + [fn for fn in found if inspect.isfunction(fn)][:1]  # last: the plain function


def ray_resource(args: Sequence[Any], kwargs: Mapping[str, Any]) -> Hashable | None:
    target, method, *_ = _parts(args, kwargs)
    if method is None:
        return None  # a task may touch anything
    return ("ray_actor", target._actor_id.hex())


def _batched_variant(target: Any, method: str | None) -> Any | None:
    for fn in _target_functions(target, method):
        if fn is not None and id(fn) in _BATCHED:
            return _BATCHED[id(fn)]
    return None


def ray_batch_key(args: Sequence[Any], kwargs: Mapping[str, Any]) -> Hashable | None:
    target, method, call_args, call_kwargs, options = _parts(args, kwargs)
    if call_kwargs or options or _batched_variant(target, method) is None:
        return None
    return (ray_resource(args, kwargs) or ("ray_task", id(target)), method)


def register_batched(fn: Any, batched: Any) -> Any:
    """Declare that ``batched`` serves several calls of ``fn`` in one request.

    For an actor method, both are methods of the actor class (``register_batched(Server.lookup,
    Server.lookup_many)``); for a task, both are ``@ray.remote`` functions. ``batched`` receives
    the list of the calls' argument tuples and returns the list of their results; object refs
    among those arguments arrive as refs (Ray resolves only top-level arguments), so ``batched``
    calls ``ray.get`` on them. Only reads (:func:`~distopt.remote.registry.register_read`) are
    batched.
    """
    key = getattr(fn, "__func__", fn)
    if inspect.isfunction(key) or inspect.ismethod(fn):
        name = getattr(batched, "__name__", None)
        if not isinstance(name, str):
            raise ConfigError(f"register_batched: {batched!r} is not a method")
        _check_takes_the_calls(batched, name, method=True)
        _BATCHED[id(key)] = name  # actors: called by name on the handle
    else:
        python_fn = getattr(batched, "_function", batched)  # a @ray.remote function's own function
        _check_takes_the_calls(batched, getattr(python_fn, "__name__", repr(batched)), method=False)
        _BATCHED[id(key)] = batched
    return fn


def _check_takes_the_calls(batched: Any, name: str, *, method: bool) -> None:
    """A one-line error now, not a Ray error at the first batched step, when ``batched`` cannot
    be called with one argument (after ``self`` for a method): the list of argument tuples."""
    python_fn = getattr(batched, "_function", batched)  # a @ray.remote function's own function
    python_fn = getattr(python_fn, "__func__", python_fn)
    try:
        signature = inspect.signature(python_fn)
    except (TypeError, ValueError):
        return  # a builtin or C function: nothing to check against
    try:
        signature.bind(*((None,) if method else ()), [])
    except TypeError:
        # Ray adds a keyword-only _ray_trace_ctx to the functions it wraps: not the user's.
        shown = f"{name}({', '.join(p for p in signature.parameters if not p.startswith('_ray_'))})"
        raise ConfigError(
            f"register_batched: {shown} must take one argument{' after self' if method else ''}, "
            "the list of the calls' argument tuples"
        ) from None


# --------------------------------------------------------------------------- routing


def _actor_call(
    method: Any, args: Any = None, kwargs: Any = None, **options: Any
) -> tuple[Any, tuple[Any, ...]]:
    """``ActorMethod._remote(args, kwargs, **options)`` as a call of :func:`ray_remote`."""
    given = {k: v for k, v in options.items() if v is not None and v != ""}
    call = (method._actor, method._method_name, tuple(args or ()), dict(kwargs or {}), given)
    return _CANONICAL["issue"], call


def _task_call(
    fn: Any, args: Any = None, kwargs: Any = None, **options: Any
) -> tuple[Any, tuple[Any, ...]]:
    """``RemoteFunction._remote(args, kwargs, **options)`` as a call of :func:`ray_remote`;
    options that only repeat the ``@ray.remote`` defaults (what ``fn.remote`` passes) are dropped."""
    options.pop("serialized_runtime_env_info", None)
    defaults = dict(fn._default_options)
    given = {k: v for k, v in options.items() if k != "max_calls" and defaults.get(k, None) != v}
    return _CANONICAL["issue"], (fn, None, tuple(args or ()), dict(kwargs or {}), given)


def _install(ray: ModuleType) -> None:
    """Declare Ray's idioms, once the model's code has imported ``ray`` (importing it loads
    ``ray.actor`` and ``ray.remote_function`` too)."""
    _CANONICAL["issue"] = ray_remote
    torch.fx.node.has_side_effect(ray.get)  # an unused ray.get still waits (for a write)
    register_remote(
        ray_call,
        issue=ray_remote,
        wait=cast(Callable[[Any], Any], ray.get),
        effect=ray_effect,
        resource=ray_resource,
        batched=ray_remote_many,
        batch_key=ray_batch_key,
        aliases=[(vars(ray), "get")],
        runs=ray_runs,
    )
    for cls in (ray.actor.ActorHandle, ray.remote_function.RemoteFunction, ray.ObjectRef):
        register_constant_type(cls)
    register_routed_method(ray.actor.ActorMethod, "_remote", _actor_call)
    register_routed_method(ray.remote_function.RemoteFunction, "_remote", _task_call)


register_on_import("ray", _install)
