"""Walk a graph with one clock: how long a forward step takes given node costs and RPC latency.

* every local node costs what the profiler measured (:func:`distopt.estimate.profile.profile_nodes`);
* every remote request costs ``rpc_latency_s``, whatever it took locally while profiling;
* a blocking call adds its latency to the clock; an issue starts a request that is ready
  ``rpc_latency_s`` later, and its wait advances the clock to ``max(now, ready)`` — so the local
  work between an issue and its wait hides (overlaps) the latency.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch.fx
from torch.fx import Node

from distopt.passes.remote.nodes import remote_ops


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
    rpc_latency_s: float,
    head_start_s: Mapping[str, float] | None = None,
) -> Timeline:
    """Walk ``gm`` in order with one clock: local nodes add their cost, waits block until ready.

    ``head_start_s`` names issues that were sent that many seconds before the step reached them
    (a pipeline prefetched them during an earlier step): their requests are ready sooner.
    """
    early = head_start_s or {}
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
            ready[node] = clock + max(0.0, rpc_latency_s - early.get(node.name, 0.0))
            requests += 1
        else:
            done = ready.get(op.start, clock)
            blocked += max(0.0, done - clock)
            clock = max(clock, done)
    return Timeline(total_s=clock, compute_s=compute, blocked_s=blocked, requests=requests)
