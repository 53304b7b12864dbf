"""Drop calls that return their input unchanged (``nn.Identity``).

Eval-mode dropout is kept on purpose: the module may be switched back to ``train()`` later.
"""

from __future__ import annotations

import torch.fx
from torch import nn

from distopt.passes.core.pass_base import PassContext, PassResult, PassSpec
from distopt.text import plural


def remove_identity(gm: torch.fx.GraphModule, ctx: PassContext) -> PassResult:
    """Replace no-op module calls by their input.

    Before::

        identity = self.identity(x);  linear = self.fc(identity)

    After::

        linear = self.fc(x)
    """
    removed = 0
    modules = dict(gm.named_modules())
    for node in list(gm.graph.nodes):
        if node.op != "call_module" or len(node.args) != 1 or node.kwargs:
            continue
        if type(modules[str(node.target)]) is not nn.Identity:
            continue
        source = node.args[0]
        if not isinstance(source, torch.fx.Node):
            continue
        node.replace_all_uses_with(source)
        gm.graph.erase_node(node)
        removed += 1
    return PassResult(
        modified=removed > 0, detail=f"removed {plural(removed, 'no-op call')}", same_cost=True
    )


PASS = PassSpec(
    name="remove_identity",
    fn=remove_identity,
    # Local cleanup first: the remote passes then see the model's calls without no-op modules.
    before=("pair_user_waits", "split_remote"),
)
"""This module's pass, listed with the other built-ins in :mod:`distopt.passes`."""
