"""Helper functions that wrap a blocking RPC, found in a model's code and declared as remote calls.

The RPC tutorials call remote objects through a helper::

    def _remote_method(method, rref, *args, **kwargs):
        args = [method, rref] + list(args)
        return rpc.rpc_sync(rref.owner(), _call_method, args=args, kwargs=kwargs)

A helper like it (any name, any module the model's code reaches) is a blocking remote call: its
body only prepares the arguments and returns ``rpc_sync(...)``. :func:`declare_helpers` finds them
by reading their source and registers each with an *async twin*: the same function whose
``rpc_sync`` is ``rpc_async`` (so it returns the future). The helper then is one graph node, as the
user wrote it, in the symbolic tier and under Dynamo (where tracing into it would stop at
``rref.owner()``, a C++ method Dynamo cannot follow).

Effect and resource of a call come from its arguments: a call on an RRef touches that remote
object, and runs ``method`` on it when the arguments are ``(method, rref, ...)`` (the tutorials'
convention); otherwise the function the helper sends (``rpc_sync(to, fn, ...)``) decides.
"""

from __future__ import annotations

import ast
import inspect
import textwrap
import types
from collections.abc import Hashable, Mapping, Sequence
from typing import Any

import torch.distributed.rpc as rpc

from distopt.remote import registry
from distopt.remote.registry import Effect
from distopt.remote.rpc_calls import default_effect, is_rref

# Functions seen, by id (each kept alive here, so an id is never reused while recorded).
_DECLARED: dict[int, Any] = {}
_REJECTED: dict[int, Any] = {}


def _returned_rpc_call(fn: types.FunctionType) -> ast.Call | None:
    """The ``rpc_sync(...)`` call ``fn`` returns, when its body does nothing else remote."""
    if "rpc_sync" not in fn.__code__.co_names:
        return None  # no name or attribute rpc_sync in its code: no need to parse its source
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    except (OSError, TypeError, SyntaxError, IndentationError):
        return None
    defs = [n for n in tree.body if isinstance(n, ast.FunctionDef)]
    if len(defs) != 1:
        return None
    body = [
        s
        for s in defs[0].body
        if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))
    ]
    if not body or not isinstance(body[-1], ast.Return) or not isinstance(body[-1].value, ast.Call):
        return None
    call = body[-1].value
    if not _names_rpc(fn, call.func, "rpc_sync"):
        return None
    # Everything before the return only prepares arguments: assignments free of RPC calls.
    for statement in body[:-1]:
        if not isinstance(statement, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            return None
        for node in ast.walk(statement):
            if isinstance(node, ast.Call) and any(_names_rpc(fn, node.func, n) for n in _RPC_APIS):
                return None
    return call


_RPC_APIS = ("rpc_sync", "rpc_async", "remote")


def _names_rpc(fn: types.FunctionType, expr: ast.expr, api: str) -> bool:
    """Whether ``expr`` names ``torch.distributed.rpc.<api>`` in ``fn``'s globals."""
    target = getattr(rpc, api)
    if isinstance(expr, ast.Name):
        return fn.__globals__.get(expr.id) is target
    if isinstance(expr, ast.Attribute) and expr.attr == api:
        base = expr.value
        if isinstance(base, ast.Name):
            return getattr(fn.__globals__.get(base.id), api, None) is target
        return True  # torch.distributed.rpc.rpc_sync written out
    return False


def _sent_function(fn: types.FunctionType, call: ast.Call) -> Any:
    """The function the helper's ``rpc_sync`` sends, when it is a global name (else ``None``)."""
    node = (
        call.args[1]
        if len(call.args) > 1
        else next((k.value for k in call.keywords if k.arg == "func"), None)
    )
    return fn.__globals__.get(node.id) if isinstance(node, ast.Name) else None


def _async_twin(fn: types.FunctionType) -> types.FunctionType:
    """``fn`` with ``rpc_sync`` replaced by ``rpc_async``: it returns the future.

    The twin reads a copy of ``fn``'s globals in which every name of ``rpc_sync`` (or of the
    ``torch.distributed.rpc`` module) answers with its async form.
    """
    shim = types.SimpleNamespace(**{k: getattr(rpc, k) for k in dir(rpc) if not k.startswith("__")})
    shim.rpc_sync = rpc.rpc_async
    namespace = dict(fn.__globals__)
    for name, value in fn.__globals__.items():
        if value is rpc.rpc_sync:
            namespace[name] = rpc.rpc_async
        elif value is rpc:
            namespace[name] = shim
    twin = types.FunctionType(
        fn.__code__, namespace, f"{fn.__name__}_async", fn.__defaults__, fn.__closure__
    )
    twin.__kwdefaults__ = fn.__kwdefaults__
    twin.__qualname__ = f"{fn.__qualname__}_async"
    twin.__module__ = fn.__module__
    return twin


def _method_and_rref(args: Sequence[Any]) -> tuple[Any, Any]:
    """``(method, rref)`` of the tutorials' ``helper(method, rref, *args)``; else ``(None, first RRef)``."""
    if len(args) >= 2 and callable(args[0]) and is_rref(args[1]):
        return args[0], args[1]
    return None, next((a for a in args if is_rref(a)), None)


def _effect(helper: Any, sent: Any) -> Any:
    def effect(args: Sequence[Any], kwargs: Mapping[str, Any]) -> Effect:
        declared = registry.declared_effect(helper)
        if declared is not None:
            return declared
        method, _ = _method_and_rref(args)
        return default_effect(method if method is not None else sent)

    return effect


def _runs(helper: Any, sent: Any) -> Any:
    def runs(args: Sequence[Any], kwargs: Mapping[str, Any]) -> list[Any]:
        method, _ = _method_and_rref(args)
        return [helper, method if method is not None else sent]

    return runs


def _resource(helper: Any) -> Any:
    def resource(args: Sequence[Any], kwargs: Mapping[str, Any]) -> Hashable:
        _, rref = _method_and_rref(args)
        if rref is not None:
            return ("rref", id(rref))
        table = next((a for a in args if isinstance(a, str)), None)
        return ("helper", id(helper), table)

    return resource


def _user_function(fn: types.FunctionType) -> bool:
    module = fn.__module__ or ""
    return not module.startswith("torch.") and (
        not module.startswith("distopt.") or module.startswith("distopt.models")
    )


def is_rpc_helper(fn: Any) -> bool:
    """Whether ``fn`` is a helper :func:`declare_helpers` found wrapping a blocking RPC."""
    return id(fn) in _DECLARED and _DECLARED[id(fn)] is fn


def declare_helpers(namespaces: Sequence[dict[str, Any]]) -> list[Any]:
    """Register every blocking-RPC helper found in ``namespaces`` (once per function); returns them."""
    found = []
    for namespace in namespaces:
        for value in list(namespace.values()):
            if not isinstance(value, types.FunctionType) or not _user_function(value):
                continue
            key = id(value)
            if key in _DECLARED:
                found.append(value)
                continue
            if key in _REJECTED or registry.is_remote_call(value):
                continue
            call = _returned_rpc_call(value)
            if call is None:
                _REJECTED[key] = value
                continue
            sent = _sent_function(value, call)
            registry.register_remote(
                value,
                issue=_async_twin(value),
                effect=_effect(value, sent),
                resource=_resource(value),
                runs=_runs(value, sent),
            )
            _DECLARED[key] = value
            found.append(value)
    return found
