"""Remote call sites: one remote call as written, with its non-tensor arguments taken as constants.

Dynamo puts a site's number in the graph (see :mod:`distopt.capture.dynamo_remote`); the site keeps
the function and the arguments that are not tensors (RRefs, names, methods: each a constant, its
identity part of the key), and where the tensors go. A run of the original model teaches the
sites their output shapes (:func:`learn`), which Dynamo needs before it can run a graph on fake
tensors, and its recording can answer them again (:func:`replaying`) in a verification run.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import threading
from collections.abc import Callable, Hashable, Iterator, Mapping, Sequence
from typing import Any

import torch

from distopt.remote import registry
from distopt.remote.record import Recording
from distopt.remote.registry import RemoteCallSpec

_SLOT = "<tensor>"


def structure(value: Any) -> Any:
    """A hashable picture of an argument tree: where tensors and other leaves go."""
    if isinstance(value, torch.Tensor):
        return _SLOT
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, *[structure(v) for v in value])
    if isinstance(value, dict):
        return ("dict", *[(k, structure(v)) for k, v in value.items()])
    return "leaf"


def leaves(value: Any) -> list[Any]:
    if isinstance(value, (list, tuple)):
        return [leaf for v in value for leaf in leaves(v)]
    if isinstance(value, dict):
        return [leaf for v in value.values() for leaf in leaves(v)]
    return [value]


def _rebuild(structure: Any, tensors: Iterator[Any], constants: Iterator[Any]) -> Any:
    if structure == _SLOT:
        return next(tensors)
    if structure == "leaf":
        return next(constants)
    kind, *items = structure
    if kind == "dict":
        return {k: _rebuild(s, tensors, constants) for k, s in items}
    built = [_rebuild(s, tensors, constants) for s in items]
    return tuple(built) if kind == "tuple" else built


def _constant(leaf: Any) -> Hashable:
    if leaf is None or isinstance(leaf, (bool, int, float, str)):
        return ("value", leaf)
    return ("object", id(leaf))


@dataclasses.dataclass(frozen=True, eq=False)
class Site:
    """One remote call as written: the function and its arguments with tensors left out."""

    index: int
    spec: RemoteCallSpec
    structure: Any
    """Of ``(args, kwargs)``: see :func:`_structure`."""
    constants: tuple[Any, ...]
    """The non-tensor leaves, in order."""
    where: str = ""

    def bind(self, tensors: Sequence[Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        args, kwargs = _rebuild(self.structure, iter(tensors), iter(self.constants))
        return tuple(args), dict(kwargs)


SITES: list[Site] = []
_KEYS: dict[Hashable, int] = {}
_KEPT: dict[int, Any] = {}  # objects a site key names by id, kept alive so ids stay unique
_LOCK = threading.Lock()


def site_key(fn: Callable[..., Any], args: Sequence[Any], kwargs: Mapping[str, Any]) -> Hashable:
    tree = (tuple(args), dict(kwargs))
    found = [leaf for leaf in leaves(tree) if not isinstance(leaf, torch.Tensor)]
    return (id(fn), structure(tree), tuple(_constant(leaf) for leaf in found))


@torch.compiler.assume_constant_result
def site_for(fn: Callable[..., Any], structure: Any, *constants: Any) -> int:
    """The site of a call (created on first sight): Dynamo runs this at trace time, with the real
    objects, and puts the number it returns in the graph (guarding on the objects' identity)."""
    spec = registry.lookup(fn)
    assert spec is not None
    key = (id(fn), structure, tuple(_constant(c) for c in constants))
    with _LOCK:
        index = _KEYS.get(key)
        if index is None:
            index = _KEYS[key] = len(SITES)
            SITES.append(Site(index, spec, structure, constants))
            for c in constants:
                _KEPT.setdefault(id(c), c)
    return index


# -------------------------------------------------------------------------------- what shapes


@dataclasses.dataclass(frozen=True)
class _Output:
    kind: str
    """``"tensor"``, ``"tuple"``, ``"list"`` or ``"none"``."""
    metas: tuple[tuple[tuple[int, ...], torch.dtype], ...]


ORACLE: dict[tuple[Hashable, tuple[Any, ...]], _Output] = {}


def in_meta(tensors: Sequence[torch.Tensor]) -> tuple[Any, ...]:
    return tuple((tuple(t.shape), t.dtype) for t in tensors)


def flat_output(value: Any) -> tuple[_Output, tuple[torch.Tensor, ...]]:
    if value is None:
        return _Output("none", ()), ()
    if isinstance(value, torch.Tensor):
        return _Output("tensor", ((tuple(value.shape), value.dtype),)), (value,)
    if isinstance(value, (list, tuple)) and all(isinstance(v, torch.Tensor) for v in value):
        metas = tuple((tuple(v.shape), v.dtype) for v in value)
        return _Output(type(value).__name__, metas), tuple(value)
    raise TypeError(f"a remote call returned {type(value).__name__}; Dynamo graphs need tensors")


def learn(recording: Recording) -> int:
    """Remember the output shapes of every recorded call for its site; returns how many."""
    learned = 0
    for call in recording.calls:
        if call.args is None or registry.lookup(call.fn) is None:
            continue
        tensors = [
            leaf for leaf in leaves((call.args, call.kwargs)) if isinstance(leaf, torch.Tensor)
        ]
        value = call.value.wait() if isinstance(call.value, torch._C.Future) else call.value
        with contextlib.suppress(TypeError):
            ORACLE[(site_key(call.fn, call.args, call.kwargs or {}), in_meta(tensors))] = (
                flat_output(value)[0]
            )
            learned += 1
    return learned


class UnknownRemoteOutput(RuntimeError):
    """Dynamo needs a remote call's output shapes that no run of the original model has shown."""


_STATE = threading.local()


def missed(site: Site, meta: tuple[Any, ...]) -> None:
    _STATE.missed = (site, meta)


def takemissed() -> tuple[Site, tuple[Any, ...]] | None:
    """The site whose outputs were unknown in this thread's last compile, if any (then forgets)."""
    missed = getattr(_STATE, "missed", None)
    _STATE.missed = None
    return missed


def key_of(site: Site) -> Hashable:
    return (id(site.spec.fn), site.structure, tuple(_constant(c) for c in site.constants))


class _Replayer:
    """Recorded results by site key, taken in call order (a verification run of the optimized model)."""

    def __init__(self, recording: Recording) -> None:
        self.values: dict[Hashable, collections.deque[Any]] = collections.defaultdict(
            collections.deque
        )
        for call in recording.calls:
            if call.args is not None:
                self.values[site_key(call.fn, call.args, call.kwargs or {})].append(call.value)

    def take(self, site: Site) -> Any:
        queue = self.values.get(key_of(site))
        if not queue:
            raise RuntimeError(
                f"verification: remote site {site.index} was not called by the original model"
            )
        value = queue.popleft()
        return value.wait() if isinstance(value, torch._C.Future) else value


def replayer() -> _Replayer | None:
    return getattr(_STATE, "replay", None)


@contextlib.contextmanager
def replaying(recording: Recording) -> Iterator[None]:
    """Inside, this thread's remote sites answer from ``recording`` instead of the servers."""
    before = replayer()
    _STATE.replay = _Replayer(recording)
    try:
        yield
    finally:
        _STATE.replay = before


def input_signature(args: Sequence[Any], kwargs: Mapping[str, Any]) -> Hashable:
    """Shapes and dtypes of a call's tensor inputs (what decides the remote calls' output shapes)."""
    tensors = [
        leaf for leaf in leaves((tuple(args), dict(kwargs))) if isinstance(leaf, torch.Tensor)
    ]
    return (structure((tuple(args), dict(kwargs))), in_meta(tensors))
