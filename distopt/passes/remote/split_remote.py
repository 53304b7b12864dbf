"""Split each blocking remote call into an asynchronous issue and a wait."""

from __future__ import annotations

import torch.fx

from distopt.passes.core.pass_base import PassContext, PassResult, PassSpec
from distopt.remote.ops import remote_ops
from distopt.remote.wait import source_line
from distopt.text import plural


def split_remote(gm: torch.fx.GraphModule, ctx: PassContext) -> PassResult:
    """Replace each blocking remote call by its registered issue plus the spec's wait op.

    The wait op (``spec.wait_op``, see :mod:`distopt.remote.wait`) runs inside a
    ``distopt.wait:<name>`` profiler range and turns a failure into a ``RemoteCallError`` carrying
    the server's message and the user's source line (a constant argument, so it survives
    re-tracing).

    Before::

        fetch = fetch(x, 'user', ids)
        linear = self.fc(fetch)

    After::

        fetch_issue = fetch_async(x, 'user', ids)
        fetch_wait = wait_fetch(fetch_issue, 'model.py:12: e = fetch(...)')
        linear = self.fc(fetch_wait)
    """
    graph = gm.graph
    split = 0
    for node, op in list(remote_ops(graph).items()):
        if op.kind != "call" or node is not op.start:
            continue
        spec = op.spec
        with graph.inserting_before(node):
            issue = graph.create_node(
                "call_function", spec.issue, node.args, node.kwargs, name=f"{node.name}_issue"
            )
            wait = graph.create_node(
                "call_function", spec.wait_op, (issue, source_line(node)), name=f"{node.name}_wait"
            )
        for new in (issue, wait):
            new.meta.update(node.meta)
            new.meta["distopt_side_effect"] = True
        node.replace_all_uses_with(wait)
        graph.erase_node(node)
        split += 1
    return PassResult(
        modified=split > 0, detail=f"split {plural(split, 'remote call')} into issue + wait"
    )


PASS = PassSpec(name="split_remote", fn=split_remote)
"""This module's pass, listed with the other built-ins in :mod:`distopt.passes`."""
