"""Walk a graph with one clock: how long a forward step takes given node costs and RPC latency.

* every local node costs what the profiler measured (:func:`distopt.estimate.profile.profile_nodes`);
* every remote request costs its latency: one number for all, or a :class:`RequestLatency`
  giving each request of the model its own (measured on the model as written, found in another
  graph of it by the request's call position);
* a blocking call adds its latency to the clock; an issue starts a request that is ready that
  latency later, and its wait advances the clock to ``max(now, ready)`` — so the local work
  between an issue and its wait hides (overlaps) the latency.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch.fx
from torch.fx import Node

from distopt.remote.ops import remote_ops
from distopt.remote.record import CALL_INDEX


@dataclass(frozen=True, slots=True)
class RequestLatency:
    """Seconds each remote request of a model takes, by its call position (``CALL_INDEX``: the
    same in the captured and the optimized graph). A batched request takes its slowest member's
    time; a request with no measurement (a write, which is never sent to measure it) takes
    ``default_s``."""

    default_s: float
    by_call: Mapping[int, float] = field(default_factory=dict)

    def of(self, node: Node) -> float:
        index = node.meta.get(CALL_INDEX)
        positions = index if isinstance(index, (list, tuple)) else [index]
        known = [self.by_call[i] for i in positions if isinstance(i, int) and i in self.by_call]
        return max(known) if known else self.default_s


@dataclass(frozen=True, slots=True)
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
    gm: torch.fx.GraphModule,
    costs: Mapping[str, float],
    rpc_latency_s: float | RequestLatency,
    head_start_s: Mapping[str, float] | None = None,
) -> Timeline:
    """Walk ``gm`` in order with one clock: local nodes add their cost, waits block until ready.

    ``rpc_latency_s``: seconds of every request, or of each (:class:`RequestLatency`).
    ``head_start_s`` names issues that were sent that many seconds before the step reached them
    (a pipeline prefetched them during an earlier step): their requests are ready sooner.
    """
    early = head_start_s or {}
    latency = (
        rpc_latency_s
        if isinstance(rpc_latency_s, RequestLatency)
        else RequestLatency(rpc_latency_s)
    )
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
            seconds = latency.of(node)
            clock += seconds
            blocked += seconds
            requests += 1
        elif node is op.start:
            ready[node] = clock + max(0.0, latency.of(node) - early.get(node.name, 0.0))
            requests += 1
        else:
            done = ready.get(op.start, clock)
            blocked += max(0.0, done - clock)
            clock = max(clock, done)
    return Timeline(total_s=clock, compute_s=compute, blocked_s=blocked, requests=requests)
