"""Run a model's remote calls once and replay their results into another run.

Verification runs the original model and the optimized one on the same inputs. Remote calls must
not run twice: a write would be applied twice, and a server drawing random numbers (dropout in a
remote module) would answer differently. So the original runs under :func:`recording`, which
performs every remote call for real and keeps its result in call order, and the optimized graph
runs under :class:`Replay`, which answers each remote call and issue from that recording by the
call's position (``node.meta["distopt_call"]``, written when the graph was captured).
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.fx
from torch.futures import Future
from torch.fx import Node
from torch.utils._pytree import tree_map

from distopt.errors import VerificationError
from distopt.remote import registry
from distopt.remote.intercept import call_frame, calling_through, intercepted
from distopt.remote.registry import RemoteCallSpec
from distopt.remote.wait import is_wait
from distopt.where import defined_at, user_line

CALL_INDEX = "distopt_call"
"""``node.meta`` key: a remote call's position among the model's remote calls, in the order the
model makes them; a batched issue holds the list of its members' positions."""


@dataclasses.dataclass
class RemoteCallRecord:
    fn: Callable[..., Any]
    """What the model called: a blocking remote function or an issue (``rpc_async``...)."""
    value: Any
    """What it returned: the result, or the future/RRef of an issue."""
    args: tuple[Any, ...] | None = None
    kwargs: dict[str, Any] | None = None
    """The call's arguments (Dynamo sites are keyed by them)."""
    spec: RemoteCallSpec | None = None
    """The call's spec: its ``wait`` resolves what an issue returned (a Ray ``ObjectRef``)."""


@dataclasses.dataclass(frozen=True)
class RemoteWrite:
    """A remote write a check will not send: what the model calls, where, and what it runs."""

    call: str
    """The remote call as the user writes it (``rpc_sync``, ``ray_call``, ``fetch``...)."""
    where: str
    """The user's source line of the call."""
    undeclared: Any = None
    """The function run on the server when only the lack of a declaration makes the call a
    write (:func:`distopt.remote.registry.undeclared_write`); ``None`` for declared writes."""

    def describe(self) -> str:
        """``rpc_sync of apply_gradient (defined at f.py:9) at model.py:57: rpc.rpc_sync(...)``."""
        runs = ""
        if self.undeclared is not None:
            name = getattr(self.undeclared, "__qualname__", None) or repr(self.undeclared)
            defined = defined_at(self.undeclared)
            runs = f" of {name}" + (f" (defined at {defined})" if defined else "")
        return f"{self.call}{runs} at {self.where}"


def remote_write(
    spec: RemoteCallSpec, args: Sequence[Any], kwargs: Mapping[str, Any], where: str
) -> RemoteWrite:
    """The :class:`RemoteWrite` of a call of ``spec`` with these arguments."""
    call = getattr(spec.fn, "__name__", None) or spec.name
    return RemoteWrite(call, where, registry.undeclared_write(spec, args, kwargs))


class RemoteWriteRefused(VerificationError):
    """A run that must not change remote state reached a remote write (before sending it)."""

    def __init__(self, write: RemoteWrite) -> None:
        super().__init__(write.describe())
        self.write = write
        self.in_backward = False
        """Set when backward made the call (the forward sends no write)."""


@dataclasses.dataclass
class Recording:
    calls: list[RemoteCallRecord] = dataclasses.field(default_factory=list)


def _entry_points() -> dict[int, RemoteCallSpec]:
    """Blocking remote functions and issues (what a model calls to start a remote operation),
    with their specs."""
    found: dict[int, RemoteCallSpec] = {}
    for spec in registry.registered_specs():
        for fn in (spec.fn, spec.issue, spec.batched):
            if fn is not None:
                found.setdefault(id(fn), spec)
    return found


@contextlib.contextmanager
def recording(root: Any, *, allow_writes: bool = True) -> Iterator[Recording]:
    """Inside: ``root``'s remote calls (on this thread) run for real and are recorded in order.

    Only the outermost call counts: the ``rpc_async`` a ``RemoteModule`` makes inside its
    ``forward`` belongs to that one call. Waits and other leaves run unrecorded. With
    ``allow_writes=False`` a remote write raises :class:`RemoteWriteRefused` before it is sent.
    """
    entries: dict[int, RemoteCallSpec] = {}
    record = Recording()

    def handler(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        spec = entries.get(id(fn))
        if spec is not None and not allow_writes and fn is not spec.batched:
            if registry.effect_of(spec, args, kwargs) == "write":
                where = user_line(call_frame(sys._getframe(1))) or "an unknown line"
                raise RemoteWriteRefused(remote_write(spec, args, kwargs, where))
        with calling_through():
            value = fn(*args, **kwargs)
        if spec is not None:
            record.calls.append(RemoteCallRecord(fn, value, args, kwargs, spec))
        return value

    with intercepted(root, handler):
        entries.update(_entry_points())  # helpers found on the way in are entry points too
        yield record


def _completed(value: Any) -> Future:
    future: Future = Future()
    future.set_result(value)
    return future


def _fresh(value: Any) -> Any:
    """A replayed result: tensors detached from the reference run's autograd graph (leaves that
    required grad still do), so the two runs never share gradients."""
    return tree_map(
        lambda t: t.detach().requires_grad_(t.requires_grad) if isinstance(t, torch.Tensor) else t,
        value,
    )


def awaited(value: Any, spec: RemoteCallSpec | None) -> Any:
    """What an issued request stands for once it has answered: a future's value, an RRef's
    value, or ``spec.wait`` of another library's handle (a Ray ``ObjectRef``); ``value`` itself
    when it is a result already."""
    if isinstance(value, torch._C.Future):  # rpc_async's futures are the C++ class itself
        return value.wait()
    if hasattr(value, "to_here") and callable(value.to_here):
        return value.to_here()
    if spec is not None:
        with calling_through():
            return spec.wait(value)
    return value


def _resolved(record: RemoteCallRecord) -> Any:
    """The value a recorded call stands for: a blocking call's result, an issue's awaited one."""
    spec = record.spec
    issued = spec is not None and record.fn is spec.issue  # else a result, unless a future
    return _fresh(awaited(record.value, spec if issued else None))


class Replay(torch.fx.Interpreter):
    """Runs a captured (and optimized) graph, answering every remote call and issue from a
    :class:`Recording` of the original model instead of sending it.

    A blocking call, and the issue and waits ``split_remote``/``batch_fetch`` made of one, give
    the recorded result; an issue the user wrote gives its recorded future (or RRef), and the
    user's waits run on it as written. Remote calls made outside the graph's nodes (a push in
    the backward of a leaf's autograd function) come after the graph's in the recording, and
    :meth:`outside` answers them in that order.
    """

    def __init__(self, gm: torch.fx.GraphModule, record: Recording) -> None:
        super().__init__(gm)
        from distopt.remote.ops import remote_ops

        self.record = record
        self.starts: Mapping[Node, Any] = {
            n: op for n, op in remote_ops(gm.graph).items() if n is op.start
        }
        self.results: dict[Node, Any] = {}
        """Issues made from blocking calls: the recorded result (a list for a batched issue)."""
        wanted = sum(len(_indices(n)) for n in self.starts)
        if wanted > len(record.calls):
            raise VerificationError(
                f"the original model made {len(record.calls)} remote calls on the example inputs, "
                f"the captured graph makes {wanted}"
            )
        self.rest = record.calls[wanted:]
        """Calls the original made outside the graph's remote nodes, in order."""

    @contextlib.contextmanager
    def outside(self) -> Iterator[None]:
        """Inside, remote calls of the graph's code that are not graph nodes (made by leaves, or
        in backward) are answered from :attr:`rest` in order, never sent; a call the original
        did not make, or one it made and the candidate did not, is a :class:`VerificationError`."""
        entries = _entry_points()
        rest = iter(self.rest)
        answered = 0

        def handler(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            nonlocal answered
            spec = entries.get(id(fn))
            if spec is None:  # a wait or another leaf: not a request
                with calling_through():
                    return fn(*args, **kwargs)
            record = next(rest, None)
            if record is None or record.fn is not fn:
                where = user_line(call_frame(sys._getframe(1))) or "an unknown line"
                raise VerificationError(
                    f"the optimized model made a remote call the original did not make there: "
                    f"{getattr(fn, '__name__', fn)} at {where}"
                )
            answered += 1
            return _fresh(record.value)

        with intercepted(self.module, handler):
            entries.update(_entry_points())
            yield
        if answered != len(self.rest):
            raise VerificationError(
                f"the original model made {len(self.rest)} remote call(s) outside its graph "
                f"(e.g. in backward), the optimized model {answered}"
            )

    def run_node(self, n: Node) -> Any:
        if is_wait(n) and n.args and n.args[0] in self.results:
            value = self.results[n.args[0]]  # type: ignore[index]
            item = n.kwargs.get("item")
            return value if item is None else value[item]
        op = self.starts.get(n)
        if op is None:
            return super().run_node(n)
        calls = [self.record.calls[i] for i in _indices(n)]
        if op.kind == "call":
            return _resolved(calls[0])
        if op.kind == "batch":
            self.results[n] = [_resolved(c) for c in calls]
            return _completed(self.results[n])
        if calls[0].fn is op.spec.issue:  # the user's own issue: its waits run as written
            return calls[0].value
        self.results[n] = _resolved(calls[0])
        return _completed(self.results[n])


def _indices(node: Node) -> list[int]:
    index = node.meta.get(CALL_INDEX)
    if index is None:
        raise VerificationError(f"remote call {node.name} has no recorded position ({CALL_INDEX})")
    return list(index) if isinstance(index, (list, tuple)) else [int(index)]
