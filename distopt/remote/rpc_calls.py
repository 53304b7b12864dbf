"""``torch.distributed.rpc`` as users write it, declared to the registry.

Every standard form of a blocking remote call becomes one graph node whose spec says how to issue
it asynchronously and how to wait for it:

==========================================  =====================================================
user code                                   node (issue → wait)
==========================================  =====================================================
``rpc.rpc_sync(to, fn, args, kwargs)``      ``rpc_sync`` (``rpc_async`` → ``fut.wait()``); ``to``
                                            a name, a ``WorkerInfo`` or ``rref.owner()``
RRef helpers (``_remote_method(M.forward,   the ``rpc_sync`` inside, traced through; the RRef and
rref, x)`` of the RPC tutorials)            the method become graph constants
``rref.rpc_sync().method(x)``               :func:`rref_call` (:func:`rref_call_async`)
``rpc.remote(to, fn, args).to_here()``      :func:`remote_to_here` (``rpc.remote`` → ``to_here``)
``remote_module(x)`` (``RemoteModule``)     :func:`remote_module_call` (``forward_async``)
``rpc.rpc_async(...)`` + ``.wait()``,        left as written; ``pair_user_waits`` turns the
``torch.futures.wait_all``                  waits into wait ops so they are scheduled too
==========================================  =====================================================

**Resource**: a call on a remote object (an RRef among its arguments, or a ``RemoteModule``)
touches that object; other calls touch ``(worker, first string argument)`` (a table name).
**Effect**: :func:`~distopt.remote.registry.register_read`/``register_write`` on the function the
server runs decide; without a declaration the ``forward`` of an ``nn.Module`` and plain
``torch`` functions are reads, anything else a write.
"""

from __future__ import annotations

import sys
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed.rpc as rpc
import torch.futures
from torch import nn
from torch.distributed.rpc import rref_proxy
from torch.futures import Future

from distopt.remote.registry import Effect, declared_effect, register_leaf_function, register_remote

UNSET_TIMEOUT = rpc.constants.UNSET_RPC_TIMEOUT


# --------------------------------------------------------------------------- canonical calls


def rref_call(
    rref: Any,
    method: str,
    args: Sequence[Any] = (),
    kwargs: Mapping[str, Any] | None = None,
    timeout: float = UNSET_TIMEOUT,
) -> Any:
    """``rref.rpc_sync(timeout).<method>(*args, **kwargs)``: what the tracer records for it."""
    return getattr(rref.rpc_sync(timeout), method)(*args, **(kwargs or {}))


def rref_call_async(
    rref: Any,
    method: str,
    args: Sequence[Any] = (),
    kwargs: Mapping[str, Any] | None = None,
    timeout: float = UNSET_TIMEOUT,
) -> Future:
    """``rref.rpc_async(timeout).<method>(*args, **kwargs)``."""
    return getattr(rref.rpc_async(timeout), method)(*args, **(kwargs or {}))


def rref_call_remote(
    rref: Any,
    method: str,
    args: Sequence[Any] = (),
    kwargs: Mapping[str, Any] | None = None,
    timeout: float = UNSET_TIMEOUT,
) -> Any:
    """``rref.remote(timeout).<method>(*args, **kwargs)`` (an RRef to the result)."""
    return getattr(rref.remote(timeout), method)(*args, **(kwargs or {}))


def rref_call_to_here(
    rref: Any,
    method: str,
    args: Sequence[Any] = (),
    kwargs: Mapping[str, Any] | None = None,
    timeout: float = UNSET_TIMEOUT,
) -> Any:
    """``rref.remote().<method>(...).to_here()``: the blocking form of :func:`rref_call_remote`."""
    return rref_call_remote(rref, method, args, kwargs, timeout).to_here()


def remote_to_here(
    to: Any,
    func: Any,
    args: Sequence[Any] | None = None,
    kwargs: Mapping[str, Any] | None = None,
    timeout: float = UNSET_TIMEOUT,
) -> Any:
    """``rpc.remote(to, func, args, kwargs, timeout).to_here()``: create the value on ``to`` and
    fetch it. ``rpc.remote`` is the issue (it returns at once), ``to_here`` the wait."""
    return rpc.remote(to, func, args, kwargs, timeout).to_here()


def wait_rref(rref: Any) -> Any:
    """The wait of an ``rpc.remote`` issue: ``rref.to_here()`` (``pair_user_waits`` knows it)."""
    return rref.to_here()


@dataclass(frozen=True, eq=False)
class RemoteModuleHandle:
    """A ``RemoteModule`` as a graph constant (it refuses most ``nn.Module`` methods, so the graph
    holds it in this plain object, never as a submodule)."""

    module: Any
    path: str
    """Where the model holds it (``remote_emb``), for messages."""

    def __repr__(self) -> str:
        return f"RemoteModule({self.path})"


def remote_module_call(handle: RemoteModuleHandle, *args: Any, **kwargs: Any) -> Any:
    """``remote_module(*args, **kwargs)``: one blocking ``forward`` on the module's owner."""
    return handle.module.forward(*args, **kwargs)


def remote_module_call_async(handle: RemoteModuleHandle, *args: Any, **kwargs: Any) -> Future:
    """``remote_module.forward_async(*args, **kwargs)``."""
    return handle.module.forward_async(*args, **kwargs)


# --------------------------------------------------------------------------- effects, resources


def is_rref(value: Any) -> bool:
    return isinstance(value, rpc.PyRRef)


def worker_name(to: Any) -> str:
    """The worker a call goes to, by name (``to`` is a name, a ``WorkerInfo`` or an id)."""
    if isinstance(to, rpc.WorkerInfo):
        return to.name
    return str(to)


def _owning_class(fn: Any) -> type | None:
    """The class a plain function was defined in (``EmbeddingTable.forward`` → ``EmbeddingTable``)."""
    qualname = getattr(fn, "__qualname__", "")
    module = sys.modules.get(getattr(fn, "__module__", "") or "")
    if "." not in qualname or module is None or "<locals>" in qualname:
        return None
    owner: Any = module
    for part in qualname.split(".")[:-1]:
        owner = getattr(owner, part, None)
    return owner if isinstance(owner, type) else None


def default_effect(fn: Any, *, on_object: type | None = None, method: str | None = None) -> Effect:
    """The effect of running ``fn`` (or ``method`` of an object of class ``on_object``) on a
    server: declared, else read for a module's ``forward`` and for ``torch`` functions, else write."""
    if on_object is not None and method is not None:
        fn = getattr(on_object, method, fn)
    declared = declared_effect(fn)
    if declared is not None:
        return declared
    name: str = method or getattr(fn, "__name__", "") or ""
    owner = on_object or _owning_class(fn)
    if name == "forward" and isinstance(owner, type) and issubclass(owner, nn.Module):
        return "read"
    module = getattr(fn, "__module__", "") or ""
    if module.split(".")[0] == "torch" and not name.endswith("_"):
        return "read"  # torch.add and friends compute from their arguments
    return "write"


def _call_parts(args: Sequence[Any], kwargs: Mapping[str, Any]) -> tuple[Any, Any, tuple[Any, ...]]:
    """``(to, func, call_args)`` of an ``rpc_sync``/``rpc_async``/``rpc.remote`` call."""
    to = args[0] if args else kwargs.get("to")
    func = args[1] if len(args) > 1 else kwargs.get("func")
    call_args = args[2] if len(args) > 2 else kwargs.get("args")
    return to, func, tuple(call_args or ())


def _rref_target(func: Any, call_args: tuple[Any, ...]) -> tuple[Any | None, Any]:
    """``(rref, method)`` when the call runs a method on an RRef's value: the tutorials'
    ``_call_method(method, rref, *args)`` trampoline; else ``(None, func)``."""
    rrefs = [a for a in call_args if is_rref(a)]
    if not rrefs:
        return None, func
    if len(call_args) >= 2 and callable(call_args[0]) and is_rref(call_args[1]):
        return call_args[1], call_args[0]
    return rrefs[0], func


def rpc_effect(args: Sequence[Any], kwargs: Mapping[str, Any]) -> Effect:
    _, func, call_args = _call_parts(args, kwargs)
    rref, target = _rref_target(func, call_args)
    declared = declared_effect(func)
    if declared is not None:
        return declared
    return default_effect(target)


def rpc_runs(args: Sequence[Any], kwargs: Mapping[str, Any]) -> list[Any]:
    """What an ``rpc_sync``/``rpc.remote`` call runs on the server: the function sent, then the
    method it calls on an RRef (the tutorials' trampoline), the one to declare."""
    _, func, call_args = _call_parts(args, kwargs)
    _, target = _rref_target(func, call_args)
    return [func] if target is func else [func, target]


def rpc_stand_in(args: Sequence[Any], kwargs: Mapping[str, Any]) -> Future:
    """An ``rpc_sync``/``rpc_async`` write's arguments sent to its server, which only counts
    them: the request's cost at its real size without applying it. The server runs ``len`` on
    them, packed in one tuple: a builtin every Python unpickles, so a server of the user's own
    needs nothing of distopt (and imports nothing on its RPC thread). RRefs among the top-level
    arguments are left out: sending one forks it on the server."""
    to, _, call_args = _call_parts(args, kwargs)
    call_kwargs = (args[3] if len(args) > 3 else kwargs.get("kwargs")) or {}
    timeout = args[4] if len(args) > 4 else kwargs.get("timeout")
    sent = tuple(None if is_rref(a) else a for a in call_args)
    payload = ((sent, dict(call_kwargs)),)
    if timeout is None:
        return rpc.rpc_async(to, len, args=payload)
    return rpc.rpc_async(to, len, args=payload, timeout=timeout)


def rpc_resource(args: Sequence[Any], kwargs: Mapping[str, Any]) -> Hashable:
    to, _, call_args = _call_parts(args, kwargs)
    rref, _ = _rref_target(None, call_args)
    if rref is not None:
        return ("rref", id(rref))
    table = call_args[0] if call_args and isinstance(call_args[0], str) else None
    return (worker_name(to), table)


def _rref_class(rref: Any) -> type | None:
    """The class of the value an RRef points to: one RPC the first time, cached by the RRef."""
    try:
        # Non-blocking, as RRefProxy asks: an RRef caches the first answer as given (a type for a
        # blocking call, a future otherwise), and RRefProxy needs the future.
        answer = rref._get_type(blocking=False)
        return answer if isinstance(answer, type) else answer.wait()
    except Exception:
        return None


def _rref_call_effect(args: Sequence[Any], kwargs: Mapping[str, Any]) -> Effect:
    rref = args[0] if args else kwargs.get("rref")
    method = args[1] if len(args) > 1 else kwargs.get("method")
    if not is_rref(rref) or not isinstance(method, str):
        return "write"
    return default_effect(None, on_object=_rref_class(rref), method=method)


def _rref_call_runs(args: Sequence[Any], kwargs: Mapping[str, Any]) -> list[Any]:
    rref = args[0] if args else kwargs.get("rref")
    method = args[1] if len(args) > 1 else kwargs.get("method")
    owner = _rref_class(rref) if is_rref(rref) else None
    return [getattr(owner, method, None)] if owner is not None and isinstance(method, str) else []


def _rref_call_resource(args: Sequence[Any], kwargs: Mapping[str, Any]) -> Hashable:
    rref = args[0] if args else kwargs.get("rref")
    return ("rref", id(rref))


def _remote_module_effect(args: Sequence[Any], kwargs: Mapping[str, Any]) -> Effect:
    handle = args[0] if args else None
    if not isinstance(handle, RemoteModuleHandle):
        return "write"
    module_rref = handle.module.module_rref
    return default_effect(None, on_object=_rref_class(module_rref), method="forward")


def _remote_module_resource(args: Sequence[Any], kwargs: Mapping[str, Any]) -> Hashable:
    handle = args[0] if args else None
    return ("remote_module", id(getattr(handle, "module", handle)))


def _register() -> None:
    places = (vars(rpc), vars(rpc.api))
    register_remote(
        rpc.rpc_sync,
        issue=rpc.rpc_async,
        effect=rpc_effect,
        resource=rpc_resource,
        runs=rpc_runs,
        aliases=[(ns, "rpc_sync") for ns in places],
        stand_in=rpc_stand_in,
    )
    register_remote(
        remote_to_here,
        issue=rpc.remote,
        wait=wait_rref,
        effect=rpc_effect,
        resource=rpc_resource,
        runs=rpc_runs,
    )
    register_remote(
        rref_call,
        issue=rref_call_async,
        effect=_rref_call_effect,
        resource=_rref_call_resource,
        runs=_rref_call_runs,
    )
    register_remote(
        rref_call_to_here,
        issue=rref_call_remote,
        wait=wait_rref,
        effect=_rref_call_effect,
        resource=_rref_call_resource,
        runs=_rref_call_runs,
    )
    register_remote(
        remote_module_call,
        issue=remote_module_call_async,
        effect=_remote_module_effect,
        resource=_remote_module_resource,
    )
    # The halves users write themselves are recorded as nodes, never run on proxies.
    register_leaf_function(rpc.rpc_async, aliases=[(ns, "rpc_async") for ns in places])
    register_leaf_function(rpc.remote, aliases=[(ns, "remote") for ns in places])
    register_leaf_function(torch.futures.wait_all, aliases=[(vars(torch.futures), "wait_all")])


_register()


def rref_proxy_call(
    rref: Any, rpc_api: Any, method: str, timeout: float, *args: Any, **kwargs: Any
) -> tuple[Any, tuple[Any, ...]]:
    """The canonical function and arguments of an ``RRefProxy`` call (``rref.rpc_sync().m(*args)``
    reaches ``rref_proxy._invoke_rpc(rref, rpc_sync, "m", timeout, *args)``)."""
    api = getattr(rpc_api, "_distopt_routed", rpc_api)  # rpc_sync itself may be routed right now
    canonical = _PROXY_CANONICAL.get(id(api), _PROXY_CANONICAL[None])
    return canonical, (rref, method, tuple(args), dict(kwargs), timeout)


# Bound at import: while a model is traced, this module's global names of leaf functions answer
# with routing wrappers (see distopt.remote.intercept), so they are never looked up at call time.
_PROXY_CANONICAL: dict[int | None, Any] = {
    id(rpc.rpc_sync): rref_call,
    id(rpc.rpc_async): rref_call_async,
    id(rpc.remote): rref_call_remote,
    None: rref_call_remote,
}


RREF_PROXY_NAMESPACE = vars(rref_proxy)
"""``RRefProxy.__getattr__`` binds ``_invoke_rpc`` from here: patching it intercepts RRef calls."""
