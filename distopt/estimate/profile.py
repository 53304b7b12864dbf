"""The node profiler: how long each node of a graph takes, measured by running it.

One semantics for every caller (the cost model's prediction, the FSDP partition's balance):

* a warm-up run (allocator, lazy initialization), then ``repeats`` timed runs; a node's cost is
  the median of its timed samples;
* under ``torch.no_grad()`` unless ``grad=True``;
* the user's random stream, the module's buffers (BatchNorm statistics) and ``.grad``, and
  remote-client state such as fetched-row records are the same afterwards
  (``torch.random.fork_rng``, :func:`distopt.remote.isolation.preserved_state` and
  :func:`distopt.remote.isolation.isolated`), so profiling a model does not change what training computes;
* the node that starts a remote request (:func:`distopt.remote.ops.remote_ops`: a
  blocking call, an issue, a batched issue) costs the request's latency; its waits cost 0. By
  default the latency is measured: remote *reads* are sent in the warm-up and in every timed
  run, at the sizes the example inputs give, and a read costs the median time from sending it
  to its answer. Remote *writes* are never sent (a write must not be applied again, and a
  verification run may have applied it once already): a write, and the local nodes that need
  its result, have no cost. With ``remote_latency_s`` the caller forbids talking to servers (a
  graph pass): no remote node runs, each request costs ``remote_latency_s``, and a local node
  that needs a remote result cannot run and has no cost.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping
from typing import Any

import torch
import torch.fx
from torch.fx import Node

from distopt.errors import ConfigError
from distopt.estimate.ab import now
from distopt.remote.isolation import forked_rng, isolated, preserved_state
from distopt.remote.ops import RemoteOp, remote_ops
from distopt.remote.record import awaited


class _Unavailable:
    """The value of a node that did not run: a modeled remote node, or a node that needs one."""

    def __repr__(self) -> str:
        return "<distopt:unavailable>"


_UNAVAILABLE = _Unavailable()


class _ProfilingInterpreter(torch.fx.Interpreter):
    """Times every local node and every remote read (from sending it to its answer); remote
    writes never run, nor, when modeled, remote reads."""

    def __init__(
        self, gm: torch.fx.GraphModule, ops: Mapping[Node, RemoteOp], *, modeled: bool
    ) -> None:
        super().__init__(gm)
        self.ops = ops
        self.modeled = modeled
        self.samples: dict[str, list[float]] = {}

    def run_node(self, n: Node) -> Any:
        op = self.ops.get(n)
        if any(self.env.get(i) is _UNAVAILABLE for i in n.all_input_nodes):
            return _UNAVAILABLE
        if op is not None and (self.modeled or op.is_write):
            return _UNAVAILABLE
        if op is not None and n is not op.start:
            return super().run_node(n)  # a wait: the answer is in already (timed at the start)
        start = now()
        result = super().run_node(n)
        if op is not None and op.kind != "call":
            awaited(result, op.spec)  # an issue: the request's time runs until its answer
        if n.op not in ("placeholder", "output"):
            self.samples.setdefault(n.name, []).append(now() - start)
        return result


def profile_nodes(
    gm: torch.fx.GraphModule,
    example_inputs: tuple[Any, ...],
    *,
    repeats: int = 5,
    grad: bool = False,
    remote_latency_s: float | None = None,
) -> dict[str, float]:
    """Median seconds of each node of ``gm`` by node name (see the module docstring).

    Args:
        gm: the graph to run.
        example_inputs: positional inputs of one forward call.
        repeats: timed runs after the warm-up.
        grad: run with autograd recording (default: under ``torch.no_grad()``).
        remote_latency_s: ``None`` measures each remote read's latency (the node starting it
            costs that, its waits 0; writes are never sent and have no entry). Seconds: remote
            nodes never run; the node starting each request (call, issue, batched issue) costs
            this, its waits 0, and local nodes that need a remote result have no entry.
    """
    if repeats < 1:
        raise ConfigError(f"repeats: expected an integer >= 1, got {repeats!r}")
    if remote_latency_s is not None and not remote_latency_s >= 0:
        raise ConfigError(f"remote_latency_s: expected seconds >= 0, got {remote_latency_s!r}")
    ops = remote_ops(gm.graph)
    interpreter = _ProfilingInterpreter(gm, ops, modeled=remote_latency_s is not None)
    with (
        preserved_state(gm),
        isolated(),
        forked_rng(),
        torch.set_grad_enabled(grad),
    ):
        interpreter.run(*example_inputs)
        interpreter.samples.clear()
        for _ in range(repeats):
            interpreter.run(*example_inputs)
    costs = {name: statistics.median(samples) for name, samples in interpreter.samples.items()}
    for node, op in ops.items():
        if node is not op.start and op.start.name in costs:
            costs[node.name] = 0.0  # a wait of a request that was timed
        elif remote_latency_s is not None:
            costs[node.name] = remote_latency_s if node is op.start else 0.0
    return costs
