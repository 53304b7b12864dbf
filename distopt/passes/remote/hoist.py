"""Issue remote calls as early as their inputs and the effect order allow."""

from __future__ import annotations

import torch.fx
from torch.fx import Node

from distopt.passes.core.pass_base import PassContext, PassResult, PassSpec
from distopt.remote.ops import (
    RemoteOp,
    issue_cone,
    ordering_edges,
    remote_ops,
    reorder,
    schedule,
)
from distopt.text import plural

_PLACEHOLDER, _ISSUE, _ISSUE_INPUT, _OTHER = range(4)


class _Tracker:
    """Which issues are free to go: every node they wait for, outside their own cone, is placed.

    Only the cones of free issues are pulled forward, so the computation of an issue held back by
    a conflicting write (or by a wait it needs) stays where it was.
    """

    def __init__(self, issues: list[Node], ops: dict[Node, RemoteOp], edges: dict[Node, set[Node]]):
        self.cones = {issue: issue_cone(issue, ops) for issue in issues}
        self.remaining: dict[Node, int] = {}
        self.blocks: dict[Node, list[Node]] = {}
        for issue, cone in self.cones.items():
            blockers: set[Node] = set()
            for node in (issue, *cone):
                blockers.update(node.all_input_nodes, edges.get(node, ()))
            blockers -= cone | {issue}
            blockers = {b for b in blockers if b.op != "placeholder"}
            self.remaining[issue] = len(blockers)
            for blocker in blockers:
                self.blocks.setdefault(blocker, []).append(issue)
        self.free_cone: set[Node] = set()
        for issue, count in self.remaining.items():
            if count == 0:
                self.free_cone |= self.cones[issue]

    def placed(self, node: Node) -> list[Node]:
        freed: list[Node] = []
        for issue in self.blocks.get(node, ()):
            self.remaining[issue] -= 1
            if self.remaining[issue] == 0:
                self.free_cone |= self.cones[issue]
                freed.extend(self.cones[issue])
        return freed


def hoist_issue(gm: torch.fx.GraphModule, ctx: PassContext) -> PassResult:
    """Move each remote issue (and the pure computation of its arguments) as early as allowed.

    Reads move freely past reads; a read never moves above a write it conflicts with; writes keep
    their order; nothing crosses an in-place op or other local effect. The graph is re-scheduled
    as a list schedule that always takes a ready issue first, then the inputs of issues, then the
    remaining nodes in their current order (see ``remote_nodes`` for the ordering rules).

    Before::

        relu = torch.relu(linear)
        getitem = ids[(slice(None), 0)]
        fetch_issue = fetch_async('user', getitem)
        fetch_wait = wait_fetch(fetch_issue, 'model.py:12: ...')

    After::

        getitem = ids[(slice(None), 0)]
        fetch_issue = fetch_async('user', getitem)
        relu = torch.relu(linear)
        fetch_wait = wait_fetch(fetch_issue, 'model.py:12: ...')
    """
    graph = gm.graph
    ops = remote_ops(graph)
    issues = [n for n, op in ops.items() if n is op.start and op.kind in ("issue", "batch")]
    if not issues:
        return PassResult(modified=False, detail="no remote issues")
    nodes = [n for n in graph.nodes if n.op != "output"]
    edges = ordering_edges(nodes, ops)
    issue_set, tracker = set(issues), _Tracker(issues, ops, edges)

    def priority(node: Node) -> int:
        if node.op == "placeholder":
            return _PLACEHOLDER
        if node in issue_set:
            return _ISSUE
        return _ISSUE_INPUT if node in tracker.free_cone else _OTHER

    order = schedule(nodes, edges, priority, tracker.placed)
    before = {n: i for i, n in enumerate(nodes)}
    after = {n: i for i, n in enumerate(order)}
    moved = sum(1 for n in issues if after[n] < before[n])
    changed = reorder(graph, order)
    return PassResult(
        modified=changed, detail=f"hoisted {moved} of {plural(len(issues), 'remote issue')}"
    )


PASS = PassSpec(
    name="hoist_issue", fn=hoist_issue, after=("split_remote",), fixed_point="remote_schedule"
)
"""This module's pass, listed with the other built-ins in :mod:`distopt.passes`."""
