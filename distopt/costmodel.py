"""Predict a graph's step time from profiled node costs and a measured remote-call latency.

``predict(gm_before, gm_after, example_inputs, rpc_latency_s)`` says how long the forward graph
takes before and after the remote-call scheduling passes:

* every local node costs its median time in a profiling run (``torch.fx.Interpreter`` timing each
  node over several repetitions);
* every remote request costs ``rpc_latency_s`` (measured by the caller, e.g. with
  :func:`measure_latency`), whatever it took locally while profiling;
* a blocking call adds its latency to the clock; an issue starts a request that is ready
  ``rpc_latency_s`` later, and its wait advances the clock to ``max(now, ready)`` — so the local
  work between an issue and its wait hides (overlaps) the latency.

Profiling runs the model, remote calls included, once for real; the remote calls' results are
recorded and replayed in the timed repetitions, so the servers see a single step per profiled
graph (``gm_after`` is profiled only when its local nodes cannot be matched to ``gm_before``'s by
name).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx
from torch.fx import Node

from distopt.errors import CaptureError, ConfigError
from distopt.passes.remote.nodes import RemoteOp, remote_ops


class _TimingInterpreter(torch.fx.Interpreter):
    """Runs the graph, timing each local node; remote nodes run for real once, then replay."""

    def __init__(self, gm: torch.fx.GraphModule, ops: Mapping[Node, RemoteOp]) -> None:
        super().__init__(gm)
        self.ops = ops
        self.recorded: dict[Node, Any] | None = None
        self.times: dict[str, list[float]] = {}

    def run_node(self, n: Node) -> Any:
        if n in self.ops:
            if self.recorded is not None and n in self.recorded:
                return self.recorded[n]
            result = super().run_node(n)
            if self.recorded is not None:
                self.recorded[n] = result
            return result
        start = time.perf_counter()
        result = super().run_node(n)
        if n.op not in ("placeholder", "output"):
            self.times.setdefault(n.name, []).append(time.perf_counter() - start)
        return result


def profile_nodes(
    gm: torch.fx.GraphModule, example_inputs: tuple[Any, ...], *, repeats: int = 5
) -> dict[str, float]:
    """Median seconds of every local node of ``gm`` (by node name) over ``repeats`` timed runs.

    The first run executes the remote calls and is not timed; later runs replay their results.
    """
    if repeats < 1:
        raise ConfigError(f"repeats: expected an integer >= 1, got {repeats!r}")
    interpreter = _TimingInterpreter(gm, remote_ops(gm.graph))
    interpreter.recorded = {}
    interpreter.run(*example_inputs)
    interpreter.times.clear()
    for _ in range(repeats):
        interpreter.run(*example_inputs)
    return {name: statistics.median(samples) for name, samples in interpreter.times.items()}


@dataclass
class Timeline:
    """One graph's predicted time and what it is made of."""

    total_s: float
    compute_s: float
    """Sum of local node costs."""
    blocked_s: float
    """Time spent blocked in remote calls or waits (latency not hidden by local work)."""
    requests: int
    """Remote requests sent (a batched request counts once)."""


def simulate(
    gm: torch.fx.GraphModule, costs: Mapping[str, float], rpc_latency_s: float
) -> Timeline:
    """Walk ``gm`` in order with one clock: local nodes add their cost, waits block until ready."""
    ops = remote_ops(gm.graph)
    clock = compute = blocked = 0.0
    ready: dict[Node, float] = {}
    requests = 0
    for node in gm.graph.nodes:
        op = ops.get(node)
        if op is None:
            cost = costs.get(node.name, 0.0)
            clock += cost
            compute += cost
        elif op.kind == "call":
            clock += rpc_latency_s
            blocked += rpc_latency_s
            requests += 1
        elif node is op.start:
            ready[node] = clock + rpc_latency_s
            requests += 1
        else:
            done = ready.get(op.start, clock)
            blocked += max(0.0, done - clock)
            clock = max(clock, done)
    return Timeline(total_s=clock, compute_s=compute, blocked_s=blocked, requests=requests)


@dataclass
class Prediction:
    """Predicted time of one forward step before and after the scheduling passes."""

    before: Timeline
    after: Timeline
    rpc_latency_s: float
    fixed_s: float = 0.0
    """Time outside the graph (backward, optimizer) the caller added to both sides."""
    unmatched: list[str] = field(default_factory=list)
    """Nodes of ``gm_after`` whose cost came from profiling ``gm_after`` itself."""

    @property
    def before_s(self) -> float:
        return self.before.total_s + self.fixed_s

    @property
    def after_s(self) -> float:
        return self.after.total_s + self.fixed_s

    @property
    def speedup(self) -> float:
        return self.before_s / self.after_s if self.after_s > 0 else float("inf")

    @property
    def hidden_fraction(self) -> float:
        """Share of the blocking remote time of ``before`` that ``after`` no longer waits for."""
        if self.before.blocked_s <= 0:
            return 0.0
        return max(0.0, (self.before.blocked_s - self.after.blocked_s) / self.before.blocked_s)

    def summary(self) -> str:
        return (
            f"predicted step {self.before_s * 1e3:.2f} ms -> {self.after_s * 1e3:.2f} ms "
            f"({self.speedup:.2f}x; compute {self.after.compute_s * 1e3:.2f} ms, "
            f"{self.before.requests} -> {self.after.requests} requests at "
            f"{self.rpc_latency_s * 1e3:.2f} ms, {self.hidden_fraction:.0%} of remote wait hidden)"
        )


def predict(
    gm_before: torch.nn.Module,
    gm_after: torch.nn.Module,
    example_inputs: tuple[Any, ...],
    rpc_latency_s: float,
    *,
    repeats: int = 5,
    fixed_s: float = 0.0,
) -> Prediction:
    """Predict step time of ``gm_before`` (as captured) and ``gm_after`` (after the passes).

    Args:
        gm_before: the captured graph with blocking remote calls.
        gm_after: the optimized graph.
        example_inputs: positional inputs of one forward call.
        rpc_latency_s: measured round-trip time of one remote request, in seconds.
        repeats: timed repetitions per node (the median is used).
        fixed_s: time outside the graph (backward, optimizer step) added to both predictions.

    Both models must be torch.fx graphs (a model that fell back to eager or Dynamo has no nodes
    to cost): anything else is a one-line :class:`CaptureError`.
    """
    if not (isinstance(gm_before, torch.fx.GraphModule) and isinstance(gm_after, torch.fx.GraphModule)):
        raise CaptureError(
            f"cost model: needs torch.fx graphs, got {type(gm_before).__name__} (captured) "
            f"and {type(gm_after).__name__} (optimized)"
        )
    if not rpc_latency_s >= 0:
        raise ConfigError(f"rpc_latency_s: expected seconds >= 0, got {rpc_latency_s!r}")
    if not isinstance(example_inputs, tuple):
        example_inputs = (
            tuple(example_inputs) if isinstance(example_inputs, list) else (example_inputs,)
        )
    costs = profile_nodes(gm_before, example_inputs, repeats=repeats)
    after_ops = remote_ops(gm_after.graph)
    local = [
        n.name
        for n in gm_after.graph.nodes
        if n not in after_ops and n.op not in ("placeholder", "output")
    ]
    unmatched = [name for name in local if name not in costs]
    after_costs = dict(costs)
    if unmatched:
        after_costs.update(profile_nodes(gm_after, example_inputs, repeats=repeats))
    return Prediction(
        before=simulate(gm_before, costs, rpc_latency_s),
        after=simulate(gm_after, after_costs, rpc_latency_s),
        rpc_latency_s=rpc_latency_s,
        fixed_s=fixed_s,
        unmatched=unmatched,
    )


def measure_latency(call: Callable[[], Any], *, repeats: int = 20) -> float:
    """Median seconds of ``call()`` (e.g. one blocking fetch of a single row) after one warm-up."""
    if repeats < 1:
        raise ConfigError(f"repeats: expected an integer >= 1, got {repeats!r}")
    call()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)
