"""Delay the wait of a remote call until its first user."""

from __future__ import annotations

import torch.fx
from torch.fx import Node

from distopt.passes.core.pass_base import PassContext, PassResult, PassSpec
from distopt.remote.ops import issue_cone, must_keep_order, remote_ops
from distopt.remote.wait import is_wait
from distopt.text import plural


def sink_wait(gm: torch.fx.GraphModule, ctx: PassContext) -> PassResult:
    """Move each remote wait to just before its first user.

    A wait stops earlier at a node it must stay before (a local effect, or a remote call that
    conflicts with it: a write's wait never sinks below a conflicting read's issue, nor into the
    computation of that issue's arguments) and at the output. Waits whose value is unused (a
    push) sink to the end of the graph. Waits arriving at the same place keep their order.
    Sinking a wait can let an issue move up (and meet another to batch with): ``hoist_issue``,
    ``batch_fetch`` and this pass share the ``remote_schedule`` fixed-point group, which the
    runner repeats until nothing moves.

    Before::

        fetch_wait = wait_fetch(fetch_issue, 'model.py:12: ...')
        linear = self.bottom(dense)
        cat = torch.cat([linear, fetch_wait], 1)

    After::

        linear = self.bottom(dense)
        fetch_wait = wait_fetch(fetch_issue, 'model.py:12: ...')
        cat = torch.cat([linear, fetch_wait], 1)
    """
    moved, total = _sink_waits(gm.graph)
    return PassResult(modified=moved > 0, detail=f"sank {moved} of {plural(total, 'remote wait')}")


def _sink_waits(graph: torch.fx.Graph) -> tuple[int, int]:
    """One sweep over the waits; returns (waits moved, waits)."""
    ops = remote_ops(graph)
    position = {n: i for i, n in enumerate(graph.nodes)}
    # Hoisting put each issue, with the computation of its arguments, right after the last node
    # it had to follow; a wait that issue must follow stays before that whole block.
    feeds: dict[Node, list[Node]] = {}
    for node, op in ops.items():
        if node is op.start and op.kind in ("issue", "batch"):
            for cone_node in issue_cone(node, ops):
                feeds.setdefault(cone_node, []).append(node)
    waits = [n for n in graph.nodes if is_wait(n)]
    moved = 0

    def blocks(wait: Node, node: Node) -> bool:
        if node.op == "output" or node in wait.users or must_keep_order(wait, node, ops):
            return True
        return any(must_keep_order(wait, issue, ops) for issue in feeds.get(node, ()))

    for wait in waits:
        stop: Node = wait.next
        while not blocks(wait, stop):
            stop = stop.next
        # Waits already parked before ``stop`` that came after this one stay after it.
        target = stop
        while (
            target.prev is not wait
            and is_wait(target.prev)
            and position[target.prev] > position[wait]
        ):
            target = target.prev
        if target is wait.next:
            continue
        target.prepend(wait)
        moved += 1
    return moved, len(waits)


PASS = PassSpec(
    name="sink_wait",
    fn=sink_wait,
    after=("split_remote", "hoist_issue", "batch_fetch"),
    fixed_point="remote_schedule",
)
"""This module's pass, listed with the other built-ins in :mod:`distopt.passes`."""
