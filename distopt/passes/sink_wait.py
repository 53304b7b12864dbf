"""Delay the wait of a remote call until its first user."""

from __future__ import annotations

import dataclasses

import torch.fx
from torch.fx import Node

from distopt.passes.base import PassContext, PassResult, register_pass
from distopt.passes.batch_fetch import batch_fetch
from distopt.passes.hoist_issue import hoist_issue
from distopt.passes.remote_nodes import (
    SCHEDULE_NOTES,
    issue_cone,
    must_keep_order,
    remote_ops,
)
from distopt.passes.remote_wait import is_wait

_MAX_ROUNDS = 8


@register_pass("sink_wait", after=("split_remote", "hoist_issue", "batch_fetch"))
def sink_wait(gm: torch.fx.GraphModule, ctx: PassContext) -> PassResult:
    """Move each remote wait to just before its first user.

    A wait stops earlier at a node it must stay before (a local effect, or a remote call that
    conflicts with it: a write's wait never sinks below a conflicting read's issue, nor into the
    computation of that issue's arguments) and at the output. Waits whose value is unused (a
    push) sink to the end of the graph. Waits arriving at the same place keep their order. When
    ``hoist_issue``/``batch_fetch`` ran before, they run again after sinking until nothing moves.

    Before::

        fetch_wait = remote_wait(fetch_issue, 'model.fetch', 'model.py:12: ...')
        linear = self.bottom(dense)
        cat = torch.cat([linear, fetch_wait], 1)

    After::

        linear = self.bottom(dense)
        fetch_wait = remote_wait(fetch_issue, 'model.fetch', 'model.py:12: ...')
        cat = torch.cat([linear, fetch_wait], 1)
    """
    moved, total = _sink_waits(gm.graph)
    # Sinking a wait can let an issue move up (and meet another to batch with). Rerun the earlier
    # scheduling passes of this pipeline, with their options, and this sweep, until a whole round
    # changes nothing: running the pipeline again then changes nothing either.
    earlier = ctx.notes.get(SCHEDULE_NOTES, {})
    rescheduled = False
    for _ in range(_MAX_ROUNDS if earlier and moved else 0):
        changed = False
        for name, fn in (("hoist_issue", hoist_issue), ("batch_fetch", batch_fetch)):
            if name in earlier:
                changed |= fn(gm, dataclasses.replace(ctx, options=dict(earlier[name]))).modified
        again, total = _sink_waits(gm.graph)
        if not changed and not again:
            break
        moved, rescheduled = moved + again, rescheduled or changed
    detail = f"sank {moved} of {total} remote waits" + (
        " (issues rescheduled)" if rescheduled else ""
    )
    return PassResult(modified=moved > 0 or rescheduled, detail=detail)


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
