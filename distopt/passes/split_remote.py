"""Split each blocking remote call into an asynchronous issue and a wait."""

from __future__ import annotations

import torch.fx

from distopt.passes.base import PassContext, PassResult, register_pass
from distopt.passes.remote_nodes import remote_ops
from distopt.passes.remote_wait import remote_wait, source_line
from distopt.passes.side_effects import mark_side_effectful


@register_pass("split_remote")
def split_remote(gm: torch.fx.GraphModule, ctx: PassContext) -> PassResult:
    """Replace each blocking remote call by its registered issue plus a wait.

    The wait runs inside a ``distopt.wait:<name>`` profiler range and turns a failure into a
    ``RemoteCallError`` carrying the server's message and the user's source line (a constant
    argument, so it survives re-tracing).

    Before::

        fetch = fetch(x, 'user', ids)
        linear = self.fc(fetch)

    After::

        fetch_issue = fetch_async(x, 'user', ids)
        fetch_wait = remote_wait(fetch_issue, 'model.fetch', 'model.py:12: e = fetch(...)')
        linear = self.fc(fetch_wait)
    """
    graph = gm.graph
    split = 0
    for node, op in list(remote_ops(graph).items()):
        if op.kind != "call" or node is not op.start:
            continue
        spec = op.spec
        # Both halves have effects the dead-code pass must keep, also after re-tracing.
        mark_side_effectful(spec.issue)
        with graph.inserting_before(node):
            issue = graph.create_node(
                "call_function", spec.issue, node.args, node.kwargs, name=f"{node.name}_issue"
            )
            wait = graph.create_node(
                "call_function",
                remote_wait,
                (issue, spec.name, source_line(node)),
                name=f"{node.name}_wait",
            )
        for new in (issue, wait):
            new.meta.update(node.meta)
            new.meta["distopt_side_effect"] = True
        node.replace_all_uses_with(wait)
        graph.erase_node(node)
        split += 1
    return PassResult(modified=split > 0, detail=f"split {split} remote calls into issue + wait")
