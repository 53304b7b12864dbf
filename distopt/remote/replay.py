"""Replay a :class:`~distopt.remote.record.Recording` into another run of the model.

The optimized graph runs under :class:`Replay`, which answers each remote call and issue from the
recording of the original by the call's position (``node.meta["distopt_call"]``, written when the
graph was captured): no remote call is sent twice.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
import torch.fx
from torch.futures import Future
from torch.fx import Node
from torch.utils._pytree import tree_map

from distopt.errors import VerificationError
from distopt.remote.intercept import call_frame, calling_through, intercepted
from distopt.remote.ops import remote_ops
from distopt.remote.record import CALL_INDEX, Recording, RemoteCallRecord, awaited, entry_points
from distopt.remote.wait import is_wait
from distopt.where import user_line


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
        entries = entry_points()
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
            entries.update(entry_points())
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
