"""Which Python callables are blocking remote calls, and how to run them asynchronously.

A registered call is always a graph leaf: the tracer records it as one ``call_function`` node and
never executes it while tracing. The scheduling passes use the spec to split the call into an
asynchronous issue plus a wait, and the declared effect to decide how far the issue may move.

The ``torch.distributed.rpc`` idioms (``rpc_sync``, RRef helpers, ``rref.rpc_sync().m(...)``,
``rpc.remote(...).to_here()``, ``RemoteModule``) are registered by :mod:`distopt.remote.rpc_calls`. Whether
the function such a call runs on the server only reads is declared with :func:`register_read` (or
:func:`register_write` to overrule a default).
"""

from __future__ import annotations

import inspect
import sys
import threading
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, Literal

import torch.fx
from torch.futures import Future

from distopt.errors import ConfigError
from distopt.remote.wait import WaitOp, make_wait_op

Effect = Literal["read", "write"]
EffectFn = Callable[[Sequence[Any], Mapping[str, Any]], Effect]
ResourceFn = Callable[[Sequence[Any], Mapping[str, Any]], Hashable]
RunsFn = Callable[[Sequence[Any], Mapping[str, Any]], Sequence[Any]]
StandInFn = Callable[[Sequence[Any], Mapping[str, Any]], Future]


def wait_future(fut: Future) -> Any:
    """The default ``wait``: ``fut.wait()``."""
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
        runs: function of ``(args, kwargs)`` naming what the call runs on the server (the
            function sent by ``rpc_sync``, an RRef's method), where a :func:`register_read`
            declaration is looked for; the last is the one to declare. ``None``: the effect is
            fixed by the registration (nothing for the user to declare).
        wait_profiled: ``wait`` opens a profiler range of its own (as ``distopt.ps.wait`` does),
            so the wait op opens none around it.
        stand_in: optional function of ``(args, kwargs)`` that sends a write's arguments to the
            server the call goes to, which only counts them, and returns the future of that request:
            what a rehearsal that must not write times in the write's place (the transport at
            the sizes the step sends). Without one, a rehearsal waits a read's latency instead.
        wait_op: the graph op the passes insert to wait for an issued call (made from ``wait``
            when the spec is created; see :mod:`distopt.remote.wait`).
    """

    fn: Callable[..., Any]
    issue: Callable[..., Future]
    wait: Callable[[Future], Any] = wait_future
    effect: Effect | EffectFn = "write"
    resource: ResourceFn | None = None
    batched: Callable[..., Future] | None = None
    batch_key: ResourceFn | None = None
    aliases: tuple[tuple[dict[str, Any], str], ...] = field(default=(), compare=False)
    runs: RunsFn | None = None
    wait_profiled: bool = False
    stand_in: StandInFn | None = field(default=None, compare=False)
    wait_op: WaitOp = field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        wait_op = make_wait_op(self.name, self.wait, profiled=self.wait_profiled)
        object.__setattr__(self, "wait_op", wait_op)

    @property
    def name(self) -> str:
        return f"{getattr(self.fn, '__module__', '?')}.{getattr(self.fn, '__qualname__', repr(self.fn))}"


_LOCK = threading.Lock()
_SPECS: dict[int, RemoteCallSpec] = {}
_DECLARED_EFFECTS: dict[int, Effect] = {}


def register_remote(
    fn: Callable[..., Any],
    *,
    issue: Callable[..., Future],
    wait: Callable[[Future], Any] = wait_future,
    effect: Effect | EffectFn = "write",
    resource: ResourceFn | None = None,
    batched: Callable[..., Future] | None = None,
    batch_key: ResourceFn | None = None,
    aliases: Sequence[tuple[dict[str, Any], str]] = (),
    runs: RunsFn | None = None,
    wait_profiled: bool = False,
    stand_in: StandInFn | None = None,
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
        runs=runs,
        wait_profiled=wait_profiled,
        stand_in=stand_in,
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
    wait: Callable[[Future], Any] = wait_future,
    effect: Effect | EffectFn = "write",
    resource: ResourceFn | None = None,
    batched: Callable[..., Future] | None = None,
    batch_key: ResourceFn | None = None,
    wait_profiled: bool = False,
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
            wait_profiled=wait_profiled,
        )
        return fn

    return decorate


def unregister_remote(fn: Callable[..., Any]) -> None:
    with _LOCK:
        _SPECS.pop(id(fn), None)


def register_read(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Declare that ``fn``, run *on the server* by a remote call, only reads server state.

    ``fn`` is what the call runs: the function given to ``rpc_sync``/``rpc_async``/``rpc.remote``,
    or the method an RRef call invokes (``EmbeddingTable.forward``). Reads of one resource may
    overlap and reorder; verification runs them once and replays their results.
    """
    with _LOCK:
        _DECLARED_EFFECTS[id(_effect_key(fn))] = "read"
    return fn


def register_write(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Declare that ``fn``, run on the server by a remote call, changes server state.

    Needed only to overrule a default: the ``forward`` of an ``nn.Module`` behind an RRef or a
    ``RemoteModule`` counts as a read unless declared a write (e.g. a module whose forward updates
    its own buffers, such as BatchNorm in training mode).
    """
    with _LOCK:
        _DECLARED_EFFECTS[id(_effect_key(fn))] = "write"
    return fn


def declared_effect(fn: Any) -> Effect | None:
    """What :func:`register_read`/:func:`register_write` said about ``fn`` (``None``: nothing)."""
    return _DECLARED_EFFECTS.get(id(_effect_key(fn)))


def _effect_key(fn: Any) -> Any:
    """What a declaration is stored under: a bound method stands for its function, because each
    attribute access makes a new bound method (``ray.remote`` classes hand out bound methods)."""
    return fn.__func__ if inspect.ismethod(fn) else fn


def lookup(fn: Any) -> RemoteCallSpec | None:
    return _SPECS.get(id(fn))


def is_remote_call(fn: Any) -> bool:
    return id(fn) in _SPECS


def registered_specs() -> tuple[RemoteCallSpec, ...]:
    with _LOCK:
        return tuple(_SPECS.values())


_EXTRA_LEAVES: dict[int, Callable[..., Any]] = {}
_EXTRA_ALIASES: list[tuple[dict[str, Any], str]] = []


def register_leaf_function(
    fn: Callable[..., Any], *, aliases: Sequence[tuple[dict[str, Any], str]] = ()
) -> Callable[..., Any]:
    """Keep ``fn`` a single graph node (never run) while tracing.

    For functions that must not run on proxies: helpers passes insert (so re-tracing an optimized
    GraphModule records them) and the halves of remote calls users write themselves
    (``rpc.rpc_async``, ``torch.futures.wait_all``). ``aliases`` are extra ``(namespace, name)``
    places where ``fn`` is reachable (a package re-exporting it).
    """
    with _LOCK:
        _EXTRA_LEAVES[id(fn)] = fn
        _EXTRA_ALIASES.extend(aliases)
    return fn


def leaf_aliases() -> tuple[tuple[dict[str, Any], str], ...]:
    """Every ``(namespace, name)`` place a leaf callable is reachable besides its own module."""
    with _LOCK:
        return (*(a for spec in _SPECS.values() for a in spec.aliases), *_EXTRA_ALIASES)


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


def undeclared_write(
    spec: RemoteCallSpec, args: Sequence[Any], kwargs: Mapping[str, Any]
) -> Any | None:
    """The function a call runs on the server when the call counts as a write only because
    nothing declares it (no :func:`register_read`/:func:`register_write` on it, and no default
    makes it a read); ``None`` for reads, declared writes and calls whose effect is fixed."""
    if spec.runs is None:
        return None
    try:
        if effect_of(spec, args, kwargs) != "write":
            return None
        candidates = [fn for fn in spec.runs(args, kwargs) if fn is not None]
    except Exception:  # arguments the registry cannot read (graph values): nothing to name
        return None
    if not candidates or any(declared_effect(fn) is not None for fn in candidates):
        return None
    return candidates[-1]


_CONSTANT_TYPES: list[type] = []
_ROUTED_METHODS: list[
    tuple[type, str, Callable[..., tuple[Callable[..., Any], tuple[Any, ...]]]]
] = []
_LAZY: dict[str, Callable[[ModuleType], None]] = {}


def register_constant_type(cls: type) -> None:
    """Let the tracer keep objects of ``cls`` (remote handles) as GraphModule attributes."""
    with _LOCK:
        if cls not in _CONSTANT_TYPES:
            _CONSTANT_TYPES.append(cls)


def constant_types() -> tuple[type, ...]:
    return tuple(_CONSTANT_TYPES)


def register_routed_method(
    owner: type, name: str, canonical: Callable[..., tuple[Callable[..., Any], tuple[Any, ...]]]
) -> None:
    """Route calls of the method ``owner.name`` like calls of a leaf function.

    For remote calls made by calling a method of a library object (Ray's
    ``handle.lookup.remote(ids)``): while a model is traced or recorded, ``canonical(self, *args,
    **kwargs)`` names the registered function and the arguments that stand for the call.
    """
    with _LOCK:
        _ROUTED_METHODS.append((owner, name, canonical))


def routed_methods() -> tuple[tuple[type, str, Callable[..., Any]], ...]:
    return tuple(_ROUTED_METHODS)


def register_on_import(module: str, install: Callable[[ModuleType], None]) -> None:
    """Run ``install(module)`` (registrations about ``module``'s objects) once the module has been
    imported, with the module imported.

    distopt must import without optional libraries (Ray), and importing them costs time; a model
    that uses one has imported it before it is traced (a model cannot hold a Ray object unless
    ``ray`` is in ``sys.modules``), so :func:`install_imported` (called when a model's remote calls
    are routed) is early enough, and distopt never imports the library itself.
    """
    with _LOCK:
        _LAZY[module] = install
    install_imported()


def install_imported() -> None:
    """Run the :func:`register_on_import` installers whose module is imported by now."""
    with _LOCK:
        # A module set to None in sys.modules is one an import refused (absent, or blocked).
        ready = [name for name in _LAZY if sys.modules.get(name) is not None]
        installs = [(_LAZY.pop(name), sys.modules[name]) for name in ready]
    for install, module in installs:
        install(module)
