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
from collections.abc import Callable, Iterator, Mapping
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
from distopt.where import caller_stack

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


class RemoteWriteRefused(VerificationError):
    """A run that must not change remote state reached a remote write; names where."""


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
                raise RemoteWriteRefused(f"{spec.name} (called at {caller_stack(call_frame(sys._getframe(1)), limit=1).strip()})")
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


def _resolved(record: RemoteCallRecord) -> Any:
    """The value a recorded call stands for: a blocking call's result, an issue's awaited one."""
    value = record.value
    if isinstance(value, torch._C.Future):  # rpc_async's futures are the C++ class itself
        return _fresh(value.wait())
    if hasattr(value, "to_here") and callable(value.to_here):
        return _fresh(value.to_here())
    spec = record.spec
    if spec is not None and record.fn is spec.issue:  # another library's handle of a result
        with calling_through():
            return _fresh(spec.wait(value))
    return _fresh(value)


class Replay(torch.fx.Interpreter):
    """Runs a captured (and optimized) graph, answering every remote call and issue from a
    :class:`Recording` of the original model instead of sending it.

    A blocking call, and the issue and waits ``split_remote``/``batch_fetch`` made of one, give
    the recorded result; an issue the user wrote gives its recorded future (or RRef), and the
    user's waits run on it as written.
    """

    def __init__(self, gm: torch.fx.GraphModule, record: Recording) -> None:
        super().__init__(gm)
        from distopt.passes.remote.nodes import remote_ops

        self.record = record
        self.starts: Mapping[Node, Any] = {n: op for n, op in remote_ops(gm.graph).items() if n is op.start}
        self.results: dict[Node, Any] = {}
        """Issues made from blocking calls: the recorded result (a list for a batched issue)."""
        wanted = sum(len(_indices(n)) for n in self.starts)
        if wanted != len(record.calls):
            raise VerificationError(
                f"the original model made {len(record.calls)} remote calls on the example inputs, "
                f"the captured graph makes {wanted}"
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
