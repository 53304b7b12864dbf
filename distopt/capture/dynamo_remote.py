"""Remote calls as nodes of the graphs Dynamo captures, instead of graph breaks.

Dynamo cannot trace a remote call: ``rpc_sync`` is C++ underneath, and an RRef helper stops at
``rref.owner()``. While distopt captures a model, every registered blocking remote function (RPC
helpers found in the model's code included, see :mod:`distopt.remote.helpers`) answers Dynamo with
a polyfill (``torch._dynamo.substitute_in_graph``) that records one node::

    remote_call = distopt_capture_dynamo_remote_remote_call(3, [l_ids_])   # site 3, its tensors
    e0 = remote_call[0]

A *site* is one call as written: the function, its non-tensor arguments (RRefs, names, methods,
taken as constants with identity guards, so no recompiles) and where its tensors go. The node's
spec (registered below) gives the scheduling passes the site's own issue, wait, effect, resource
and batching, so a Dynamo graph is rewritten like a traced one.

Dynamo computes every node's output on fake tensors first. A remote call cannot run on them, so
its output shapes come from a real run of the original model (:func:`learn`): the example inputs'
verification run, or — without example inputs — the first call of each new input shape, which
runs the original model eagerly (see :class:`CapturedCall`). Outside a distopt capture the
polyfills step aside and Dynamo treats the functions as it always did.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import threading
import types
import warnings
from collections.abc import Callable, Hashable, Iterator, Mapping, Sequence
from typing import Any, TextIO

import torch
import torch._dynamo
from torch._dynamo.exc import unimplemented
from torch._subclasses.fake_tensor import is_fake

from distopt.capture.sites import (
    ORACLE,
    SITES,
    Site,
    UnknownRemoteOutput,
    flat_output,
    in_meta,
    input_signature,
    key_of,
    learn,
    leaves,
    missed,
    replayer,
    replaying,
    site_for,
    structure,
)
from distopt.errors import DistoptFallbackWarning
from distopt.remote import registry
from distopt.remote.record import Recording, recording
from distopt.where import describe_failure

_STATE = threading.local()


def _fake_output(site: Site, tensors: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    meta = in_meta(tensors)
    out = ORACLE.get((key_of(site), meta))
    if out is None:
        # A graph break, not an error: Dynamo runs this call as written, once, and goes on.
        missed(site, meta)
        message = (
            f"no run of the original model has shown the outputs of remote call site {site.index}"
        )
        try:
            unimplemented(
                gb_type="distopt: remote call with unknown outputs",
                context=f"site {site.index}",
                explanation=message,
                hints=["distopt learns them from the first call of each input shape"],
            )
        except TypeError:  # another torch: an error instead, which the learning call handles
            raise UnknownRemoteOutput(message) from None
    return tuple(torch.empty(shape, dtype=dtype) for shape, dtype in out.metas)


def _fresh(value: Any) -> Any:
    return (
        value.detach().requires_grad_(value.requires_grad)
        if isinstance(value, torch.Tensor)
        else value
    )


@torch._dynamo.allow_in_graph
def remote_call(site: int, tensors: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """One blocking remote call of ``site`` with these tensors; its output tensors, flattened."""
    s = SITES[site]
    if any(is_fake(t) for t in tensors) or torch._guards.detect_fake_mode(tensors) is not None:
        return _fake_output(s, tensors)
    replay = replayer()
    if replay is not None:
        return tuple(_fresh(t) for t in flat_output(replay.take(s))[1])
    args, kwargs = s.bind(tensors)
    return flat_output(s.spec.fn(*args, **kwargs))[1]


@dataclasses.dataclass
class Pending:
    """An issued site call (or a batch of them): what :func:`remote_call_wait` resolves."""

    sites: tuple[Site, ...]
    future: Any
    batched: bool = False
    replayed: tuple[Any, ...] | None = None


def remote_call_async(site: int, tensors: list[torch.Tensor]) -> Pending:
    s = SITES[site]
    replay = replayer()
    if replay is not None:
        return Pending((s,), None, replayed=(replay.take(s),))
    args, kwargs = s.bind(tensors)
    return Pending((s,), s.spec.issue(*args, **kwargs))


def remote_call_batched(
    args_list: Sequence[Sequence[Any]], kwargs_list: Sequence[Mapping[str, Any]]
) -> Pending:
    sites = tuple(SITES[a[0]] for a in args_list)
    replay = replayer()
    if replay is not None:
        return Pending(sites, None, batched=True, replayed=tuple(replay.take(s) for s in sites))
    bound = [s.bind(a[1]) for s, a in zip(sites, args_list, strict=True)]
    spec = sites[0].spec
    assert spec.batched is not None
    return Pending(sites, spec.batched([b[0] for b in bound], [b[1] for b in bound]), batched=True)


def remote_call_wait(pending: Pending) -> Any:
    """The flattened outputs (a list of them for a batch), through the sites' own ``wait``."""
    if pending.replayed is not None:
        flat = [tuple(_fresh(t) for t in flat_output(v)[1]) for v in pending.replayed]
        return flat if pending.batched else flat[0]
    value = pending.sites[0].spec.wait(pending.future)
    if pending.batched:
        return [flat_output(v)[1] for v in value]
    return flat_output(value)[1]


def _site_of(args: Sequence[Any]) -> Site | None:
    site = args[0] if args else None
    return SITES[site] if isinstance(site, int) and 0 <= site < len(SITES) else None


def _site_view(args: Sequence[Any]) -> tuple[Site, tuple[Any, ...], dict[str, Any]] | None:
    """A site call's arguments as the site's own spec sees them (tensors left as given)."""
    site = _site_of(args)
    if site is None:
        return None
    tensors = args[1] if len(args) > 1 and isinstance(args[1], (list, tuple)) else ()
    call_args, call_kwargs = site.bind(list(tensors))
    return site, call_args, call_kwargs


def _effect(args: Sequence[Any], kwargs: Mapping[str, Any]) -> str:
    view = _site_view(args)
    return "write" if view is None else registry.effect_of(view[0].spec, view[1], view[2])


def _resource(args: Sequence[Any], kwargs: Mapping[str, Any]) -> Hashable:
    view = _site_view(args)
    return None if view is None else registry.resource_of(view[0].spec, view[1], view[2])


def _batch_key(args: Sequence[Any], kwargs: Mapping[str, Any]) -> Hashable:
    view = _site_view(args)
    if view is None or view[0].spec.batched is None or view[0].spec.batch_key is None:
        raise LookupError("not batchable")
    return (id(view[0].spec), view[0].spec.batch_key(view[1], view[2]))


registry.register_remote(
    remote_call,
    # A Pending stands in for the Future the registry's signature names (it has wait()).
    issue=remote_call_async,  # type: ignore[arg-type]
    wait=remote_call_wait,  # type: ignore[arg-type]
    effect=_effect,  # type: ignore[arg-type]
    resource=_resource,
    batched=remote_call_batched,  # type: ignore[arg-type]
    batch_key=_batch_key,
)


# -------------------------------------------------------------------------------- polyfills


@torch.compiler.assume_constant_result
def _capturing() -> bool:
    """Whether distopt is capturing on this thread (read once per compile, at trace time)."""
    return bool(getattr(_STATE, "capturing", False))


@contextlib.contextmanager
def capturing() -> Iterator[None]:
    before = getattr(_STATE, "capturing", False)
    _STATE.capturing = True
    try:
        yield
    finally:
        _STATE.capturing = before


@contextlib.contextmanager
def _dynamo_advice_silenced() -> Iterator[None]:
    """Dynamo's warnings while it compiles a captured model (``Graph break from Tensor.item(),
    consider setting: ...``) are advice to users of torch.compile; this model was not compiled at
    its user's request, and a graph break only splits its captured graph (the report counts the
    graphs). Errors still show. Its warnings too are advice (``Dynamo does not know how to trace
    the builtin ...``, where a remote call it runs as written reaches C++: the call still runs):
    they are not shown. Not through ``warnings.catch_warnings``: every change to the filters
    resets each module's once-per-location registry, and a user's warning shown once would show
    again after every step."""
    logger = logging.getLogger("torch._dynamo")
    level = logger.level
    logger.setLevel(logging.ERROR)
    show = warnings.showwarning

    def show_unless_dynamo(
        message: Warning | str,
        category: type[Warning],
        filename: str,
        lineno: int,
        file: TextIO | None = None,
        line: str | None = None,
    ) -> None:
        if not filename.startswith(_DYNAMO_DIR):
            show(message, category, filename, lineno, file, line)

    warnings.showwarning = show_unless_dynamo
    try:
        yield
    finally:
        warnings.showwarning = show
        logger.setLevel(level)


_DYNAMO_DIR = os.path.dirname(torch._dynamo.__file__) + os.sep


_POLYFILLED: dict[int, Callable[..., Any]] = {}


def _passthrough(fn: Callable[..., Any]) -> Callable[..., Any]:
    """A copy of ``fn`` Dynamo treats as it treats ``fn`` without a polyfill (same code, new object)."""
    if not isinstance(fn, types.FunctionType):
        return fn
    copy = types.FunctionType(
        fn.__code__, fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__
    )
    copy.__kwdefaults__ = fn.__kwdefaults__
    return copy


def _shim(fn: Callable[..., Any]) -> Callable[..., Any]:
    original = _passthrough(fn)

    def remote_call_site(*args: Any, **kwargs: Any) -> Any:
        if not _capturing():
            return original(*args, **kwargs)
        tree = (args, kwargs)
        found = leaves(tree)
        tensors = [leaf for leaf in found if isinstance(leaf, torch.Tensor)]
        constants = [leaf for leaf in found if not isinstance(leaf, torch.Tensor)]
        site = site_for(fn, structure(tree), *constants)
        out = remote_call(site, tensors)
        kind = _output_kind(site, *[(tuple(t.shape), t.dtype) for t in tensors])
        if kind == "tensor":
            return out[0]
        if kind == "none":
            return None
        return list(out) if kind == "list" else tuple(out)

    return remote_call_site


@torch.compiler.assume_constant_result
def _output_kind(site: int, *meta: Any) -> str:
    out = ORACLE.get((key_of(SITES[site]), tuple(meta)))
    return out.kind if out is not None else "tensor"


def polyfill_remote_calls() -> int:
    """Give Dynamo a polyfill for every registered blocking remote function (once each)."""
    added = 0
    for spec in registry.registered_specs():
        fn = spec.fn
        if id(fn) in _POLYFILLED or fn is remote_call or not isinstance(fn, types.FunctionType):
            continue
        try:
            torch._dynamo.substitute_in_graph(fn, skip_signature_check=True)(_shim(fn))
        except (ValueError, TypeError):
            continue  # Dynamo already has a rule for it: leave Dynamo's
        _POLYFILLED[id(fn)] = fn
        added += 1
    return added


# -------------------------------------------------------------------------------- learning


# -------------------------------------------------------------------------------- learning


class CapturedCall:
    """The call of a module distopt captured with Dynamo: the compiled module, run safely.

    With ``learns`` (a model making remote calls), the first call with a new input signature runs
    the module as written, its remote calls recorded so their output shapes are known
    (:func:`learn`); later calls run the compiled module, whose graphs then hold the remote calls
    as nodes. Either way each remote call runs once per call.

    A failure of Dynamo itself (not of the model: the same call runs as written first, and the
    model's own error is raised as is) switches this module to running as written, with one
    :class:`~distopt.errors.DistoptFallbackWarning` naming the cause and the user's line.
    """

    def __init__(
        self, compiled: Callable[..., Any], module: torch.nn.Module, *, learns: bool
    ) -> None:
        self.compiled = compiled
        self.module = module
        self.learns = learns
        self.known: set[Hashable] = set()
        self.eager_reason: str | None = None
        self.raising = False
        """Let a Dynamo failure raise (verification reports it instead of hiding it)."""

    def mark_known(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> None:
        self.known.add(input_signature(args, kwargs))

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.eager_reason is not None:
            return self.module._call_impl(*args, **kwargs)
        signature = input_signature(args, kwargs) if self.learns else None
        if self.learns and signature not in self.known:
            with recording(self.module) as record:
                out = self.module._call_impl(*args, **kwargs)
            learn(record)
            self.known.add(signature)
            return out
        try:
            with capturing(), _dynamo_advice_silenced():
                return self.compiled(*args, **kwargs)
        except torch._dynamo.exc.TorchDynamoException as err:
            if self.raising:
                raise
            out = self.module._call_impl(*args, **kwargs)  # the model's own error raises here
            self.eager_reason = describe_failure(err)
            warnings.warn(
                f"distopt: running {type(self.module).__name__} as written from now on: Dynamo failed: "
                f"{self.eager_reason}",
                DistoptFallbackWarning,
                stacklevel=2,
            )
            return out


@contextlib.contextmanager
def checking(
    module: torch.nn.Module, example_inputs: Sequence[Any], record: Recording
) -> Iterator[None]:
    """A verification run of a Dynamo-captured ``module``: remote calls' shapes learned from the
    original's recorded run, their results answered from it, and Dynamo failures raised."""
    learn(record)
    call = getattr(module, "_compiled_call_impl", None)
    if isinstance(call, CapturedCall):
        call.mark_known(example_inputs, {})
        call.raising = True
    try:
        with replaying(record):
            yield
    finally:
        if isinstance(call, CapturedCall):
            call.raising = False
