"""Which Python callables are blocking remote calls, and how to run them asynchronously.

A registered call is always a graph leaf: the tracer records it as one ``call_function`` node and
never executes it while tracing. The scheduling passes use the spec to split the call into an
asynchronous issue plus a wait, and the declared effect to decide how far the issue may move.

``torch.distributed.rpc.rpc_sync`` is registered out of the box. Its effect depends on the remote
function it calls: functions declared with :func:`register_read` are pure reads; any other remote
function is treated as a write (the conservative choice).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch.distributed.rpc as rpc
import torch.fx
from torch.futures import Future

from distopt.errors import ConfigError
from distopt.remote.wait import WaitOp, make_wait_op

Effect = Literal["read", "write"]
EffectFn = Callable[[Sequence[Any], Mapping[str, Any]], Effect]
ResourceFn = Callable[[Sequence[Any], Mapping[str, Any]], Hashable]


def _wait_future(fut: Future) -> Any:
    return fut.wait()


@dataclass(frozen=True)
class RemoteCallSpec:
    """How to schedule one blocking remote function.

    Attributes:
        fn: the blocking call as users write it (e.g. ``rpc_sync``).
        issue: the asynchronous counterpart taking the same arguments and returning a future.
        wait: turns the future into the value ``fn`` would have returned.
        effect: ``"read"``/``"write"`` or a function of ``(args, kwargs)`` returning one of them.
        resource: a function of ``(args, kwargs)`` naming what the call touches (server and table);
            two calls conflict only when their resources are equal. ``None`` means "conflicts with
            every other remote call".
        batched: optional ``(list_of_args, list_of_kwargs) -> future of list of results`` that
            serves several reads of the same resource group in one request.
        batch_key: function of ``(args, kwargs)`` grouping calls that ``batched`` may combine.
        aliases: extra ``(module_dict, name)`` places where ``fn`` is reachable and must be
            patched while tracing (for functions re-exported by a package).
        wait_op: the graph op the passes insert to wait for an issued call (made from ``wait``
            when the spec is created; see :mod:`distopt.remote.wait`).
    """

    fn: Callable[..., Any]
    issue: Callable[..., Future]
    wait: Callable[[Future], Any] = _wait_future
    effect: Effect | EffectFn = "write"
    resource: ResourceFn | None = None
    batched: Callable[..., Future] | None = None
    batch_key: ResourceFn | None = None
    aliases: tuple[tuple[dict[str, Any], str], ...] = field(default=(), compare=False)
    wait_op: WaitOp = field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "wait_op", make_wait_op(self.name, self.wait))

    @property
    def name(self) -> str:
        return f"{getattr(self.fn, '__module__', '?')}.{getattr(self.fn, '__qualname__', repr(self.fn))}"


_LOCK = threading.Lock()
_SPECS: dict[int, RemoteCallSpec] = {}
_READ_FUNCTIONS: set[int] = set()


def register_remote(
    fn: Callable[..., Any],
    *,
    issue: Callable[..., Future],
    wait: Callable[[Future], Any] = _wait_future,
    effect: Effect | EffectFn = "write",
    resource: ResourceFn | None = None,
    batched: Callable[..., Future] | None = None,
    batch_key: ResourceFn | None = None,
    aliases: Sequence[tuple[dict[str, Any], str]] = (),
) -> RemoteCallSpec:
    """Declare ``fn`` a blocking remote call whose asynchronous form is ``issue`` + ``wait``."""
    if not callable(fn):
        raise ConfigError(f"register_remote: fn must be callable, got {fn!r}")
    if not callable(issue):
        raise ConfigError(f"register_remote: issue for {fn!r} must be callable, got {issue!r}")
    if isinstance(effect, str) and effect not in ("read", "write"):
        raise ConfigError(f"register_remote: effect must be 'read' or 'write', got {effect!r}")
    spec = RemoteCallSpec(
        fn=fn,
        issue=issue,
        wait=wait,
        effect=effect,
        resource=resource,
        batched=batched,
        batch_key=batch_key,
        aliases=tuple(aliases),
    )
    # The issue (and batched issue) of a call must survive dead-code elimination, like the call.
    for effectful in (fn, issue, batched):
        if effectful is not None:
            torch.fx.node.has_side_effect(effectful)
    with _LOCK:
        _SPECS[id(fn)] = spec
    return spec


def remote(
    *,
    issue: Callable[..., Future],
    wait: Callable[[Future], Any] = _wait_future,
    effect: Effect | EffectFn = "write",
    resource: ResourceFn | None = None,
    batched: Callable[..., Future] | None = None,
    batch_key: ResourceFn | None = None,
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorator form of :func:`register_remote`::

        @distopt.remote(issue=fetch_async, effect="read")
        def fetch(table, ids): return fetch_async(table, ids).wait()
    """

    def decorate(fn: Callable[..., Any]) -> Callable[..., Any]:
        register_remote(
            fn,
            issue=issue,
            wait=wait,
            effect=effect,
            resource=resource,
            batched=batched,
            batch_key=batch_key,
        )
        return fn

    return decorate


def unregister_remote(fn: Callable[..., Any]) -> None:
    with _LOCK:
        _SPECS.pop(id(fn), None)


def register_read(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Mark a function executed *on the server* through ``rpc_sync`` as a pure read."""
    with _LOCK:
        _READ_FUNCTIONS.add(id(fn))
    return fn


def lookup(fn: Any) -> RemoteCallSpec | None:
    return _SPECS.get(id(fn))


def is_remote_call(fn: Any) -> bool:
    return id(fn) in _SPECS


def registered_specs() -> tuple[RemoteCallSpec, ...]:
    with _LOCK:
        return tuple(_SPECS.values())


_EXTRA_LEAVES: dict[int, Callable[..., Any]] = {}


def register_leaf_function(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Keep ``fn`` a single graph node when a rewritten graph is traced again.

    Passes that insert calls to helpers (issue, wait, split results) register those helpers so
    re-tracing an optimized GraphModule records them instead of executing them on proxies.
    """
    with _LOCK:
        _EXTRA_LEAVES[id(fn)] = fn
    return fn


def leaf_callables() -> tuple[Callable[..., Any], ...]:
    """Every callable the tracer must record as a leaf: remote calls, their async forms, helpers."""
    with _LOCK:
        found: dict[int, Callable[..., Any]] = dict(_EXTRA_LEAVES)
        for spec in _SPECS.values():
            for fn in (spec.fn, spec.issue, spec.wait, spec.batched, spec.wait_op):
                if fn is not None:
                    found.setdefault(id(fn), fn)
        return tuple(found.values())


def effect_of(spec: RemoteCallSpec, args: Sequence[Any], kwargs: Mapping[str, Any]) -> Effect:
    return spec.effect if isinstance(spec.effect, str) else spec.effect(args, kwargs)


def resource_of(
    spec: RemoteCallSpec, args: Sequence[Any], kwargs: Mapping[str, Any]
) -> Hashable | None:
    return None if spec.resource is None else spec.resource(args, kwargs)


def _rpc_arg(args: Sequence[Any], kwargs: Mapping[str, Any], index: int, name: str) -> Any:
    if len(args) > index:
        return args[index]
    return kwargs.get(name)


def _rpc_effect(args: Sequence[Any], kwargs: Mapping[str, Any]) -> Effect:
    func = _rpc_arg(args, kwargs, 1, "func")
    return "read" if id(func) in _READ_FUNCTIONS else "write"


def _rpc_resource(args: Sequence[Any], kwargs: Mapping[str, Any]) -> Hashable:
    # Calls to different workers never conflict; within a worker, a PS-style first argument
    # (the table name) narrows it further when it is a plain string.
    to = _rpc_arg(args, kwargs, 0, "to")
    call_args = _rpc_arg(args, kwargs, 2, "args") or ()
    table = call_args[0] if call_args and isinstance(call_args[0], str) else None
    return (str(to), table)


register_remote(
    rpc.rpc_sync,
    issue=rpc.rpc_async,
    effect=_rpc_effect,
    resource=_rpc_resource,
    aliases=((vars(rpc), "rpc_sync"),),
)
