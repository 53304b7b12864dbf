"""Where a rewritten graph puts its remote issues and waits relative to the local tower."""

from __future__ import annotations

import torch.fx

from distopt.remote.ops import remote_ops
from distopt.remote.wait import is_wait


def schedule(gm: torch.fx.GraphModule) -> tuple[list[int], list[int], list[int]]:
    """Positions of the issues, of the waits, and of the tower's nodes."""
    nodes = list(gm.graph.nodes)
    ops = remote_ops(gm.graph)
    issues = [i for i, n in enumerate(nodes) if n in ops and n is ops[n].start]
    waits = [i for i, n in enumerate(nodes) if is_wait(n)]
    tower = [
        i
        for i, n in enumerate(nodes)
        if n.op == "call_module" and str(n.target).startswith("tower")
    ]
    return issues, waits, tower
