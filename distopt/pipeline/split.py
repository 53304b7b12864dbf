"""Split an optimized graph into a prefetch stage and a main stage (the pipeline's two stages).

The prefetch stage is the cone of every remote *read* issue whose arguments are pure computation
of the model's inputs: the issue node and the nodes computing its arguments. It runs one batch
ahead, so the network time of those reads overlaps the previous step. Before (an optimized
DLRM)::

    def forward(self, dense, sparse):
        getitem = sparse[0];  getitem_1 = sparse[1]
        fetch_batched = fetch_batched([('emb0', getitem), ('emb1', getitem_1)], [{}, {}])
        bottom_0 = self.bottom(dense)
        fetch_wait = wait_fetch(fetch_batched, '...', item = 0)
        ...

after, the prefetch stage (issues, and the arguments they were given, per slot)::

    def forward(self, dense, sparse):
        getitem = sparse[0];  getitem_1 = sparse[1]
        fetch_batched = fetch_batched([('emb0', getitem), ('emb1', getitem_1)], [{}, {}])
        return [(fetch_batched, ([('emb0', getitem), ('emb1', getitem_1)], [{}, {}]), {})]

and the main stage, whose issue takes the prefetched future of its slot when the pipeline gave
one (checking that it was issued with equal arguments) and issues as written otherwise, so the
main stage alone is the optimized model (evaluation, verification)::

        fetch_batched = prefetched_0_fetch_batched([('emb0', getitem), ('emb1', getitem_1)], [{}, {}])

A read issue stays in the main stage when its arguments depend on parameters, modules, random
ops or remote results (a chained lookup), or when an earlier remote write in the forward conflicts
with it (a push of the same table).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import torch
import torch.fx
from torch.fx import GraphModule, Node

from distopt.pipeline.slots import slot_op
from distopt.remote.graph_args import attr_value
from distopt.remote.ops import (
    RemoteOp,
    is_pure_movable,
    is_stateful,
    ordering_edges,
    remote_ops,
)
from distopt.remote.wait import is_wait, source_line


@dataclasses.dataclass(frozen=True)
class PrefetchSplit:
    """The two stages of an optimized model (both share its parameters and constants)."""

    prefetch: GraphModule
    """``prefetch(*inputs) -> [(future, args, kwargs), ...]``, one entry per slot."""
    main: GraphModule
    """The optimized model whose issue of slot ``i`` takes a prefetched future when given one."""
    slots: tuple[str, ...]
    """Each slot's issue, as ``node name: source line`` (for reports)."""


def _pure_input_cone(issue: Node, ops: Mapping[Node, RemoteOp]) -> set[Node] | None:
    """Nodes computing ``issue``'s arguments, or ``None`` if one is not pure computation of the
    inputs and constants: stricter than the passes' :func:`is_pure_movable`, because a step
    ahead parameters have other values and modules and random ops other state."""
    cone: set[Node] = set()
    stack = list(issue.all_input_nodes)
    while stack:
        node = stack.pop()
        if node in cone or node.op == "placeholder":
            continue
        if not is_pure_movable(node, ops) or node.op == "call_module" or is_stateful(node):
            return None
        if isinstance(attr_value(node), torch.nn.Parameter):
            return None
        cone.add(node)
        stack.extend(node.all_input_nodes)
    return cone


def prefetchable(gm: GraphModule) -> list[tuple[Node, set[Node]]]:
    """The read issues of ``gm`` that can run a batch ahead, in graph order, with their cones."""
    ops = remote_ops(gm.graph)
    nodes = list(gm.graph.nodes)
    edges = ordering_edges(nodes, ops)
    found: list[tuple[Node, set[Node]]] = []
    for node in nodes:
        op = ops.get(node)
        if op is None or node is not op.start or op.kind not in ("issue", "batch") or op.is_write:
            continue
        if None in op.resources:
            continue  # unknown resource: it may conflict with any write, so it is not moved
        cone = _pure_input_cone(node, ops)
        if cone is None:
            continue
        # Effect order: whatever else the issue must follow (a conflicting write, a barrier)
        # would be crossed by running it a step ahead.
        if any(p not in cone and ops.get(p) is not ops[node] for p in edges[node]):
            continue
        found.append((node, cone))
    return found


def split_prefetch(gm: GraphModule) -> PrefetchSplit:
    """The prefetch and main stages of ``gm`` (see the module docstring); ``gm`` is unchanged.

    Raises ``ValueError`` when ``gm`` has no remote read that can run ahead.
    """
    found = prefetchable(gm)
    if not found:
        raise ValueError("no remote read whose arguments come from the inputs alone")
    prefetch_graph = torch.fx.Graph()
    env: dict[Node, Node] = {}
    wanted = set().union(*(cone for _, cone in found)) | {issue for issue, _ in found}
    outputs = []
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            env[node] = prefetch_graph.node_copy(node, lambda n: env[n])
        elif node in wanted:
            env[node] = prefetch_graph.node_copy(node, lambda n: env[n])
    for issue, _ in found:
        args = torch.fx.node.map_arg(issue.args, lambda n: env[n])
        kwargs = torch.fx.node.map_arg(issue.kwargs, lambda n: env[n])
        outputs.append((env[issue], args, kwargs))
    prefetch_graph.output(outputs)
    prefetch = GraphModule(gm, prefetch_graph, class_name="PrefetchStage")

    main_graph = torch.fx.Graph()
    remap: dict[Node, Node] = {}
    result = main_graph.graph_copy(gm.graph, remap)  # type: ignore[arg-type]
    main_graph.output(result)
    slots = []
    for index, (issue, _) in enumerate(found):
        copy = remap[issue]
        with main_graph.inserting_before(copy):
            assert callable(issue.target)  # a call_function node
            taken = main_graph.call_function(slot_op(index, issue.target), copy.args, copy.kwargs)
        taken.meta = dict(copy.meta)
        copy.replace_all_uses_with(taken)
        main_graph.erase_node(copy)
        slots.append(f"{issue.name}: {issue_line(issue)}")
    main = GraphModule(gm, main_graph, class_name=type(gm).__name__)
    main.graph.lint()
    return PrefetchSplit(prefetch=prefetch, main=main, slots=tuple(slots))


def issue_line(issue: Node) -> str:
    """The user's source lines of the calls an issue serves (its waits quote them)."""
    lines = dict.fromkeys(str(u.args[1]) for u in issue.users if is_wait(u) and len(u.args) > 1)
    return "; ".join(lines) if lines else source_line(issue)
