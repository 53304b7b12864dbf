"""Combine concurrent remote reads of one server group into a single batched request."""

from __future__ import annotations

from collections.abc import Hashable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx
from torch.fx import Node

from distopt.errors import ConfigError
from distopt.passes.core.pass_base import PassContext, PassResult, PassSpec
from distopt.remote.isolation import forked_rng
from distopt.remote.ops import (
    RemoteOp,
    batch_key_of_call,
    conflicts,
    is_pure_movable,
    must_keep_order,
    remote_ops,
)
from distopt.remote.record import CALL_INDEX
from distopt.remote.wait import is_wait
from distopt.text import plural

_OPTIONS = ("max_batch_requests", "max_batch_bytes")


@dataclass
class _Group:
    key: Hashable
    members: list[Node] = field(default_factory=list)
    nbytes: int = 0


def _limit(ctx: PassContext, name: str) -> int | None:
    value = ctx.options.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(
            f"pass_options.batch_fetch.{name}: expected an integer >= 1, got {value!r}"
        )
    return value


def _example_values(
    gm: torch.fx.GraphModule,
    wanted: list[Node],
    ops: Mapping[Node, RemoteOp],
    inputs: tuple[Any, ...],
) -> dict[Node, Any]:
    """Values of ``wanted`` nodes computable from the example inputs by pure nodes only.

    Only the pure cone of the requested nodes runs (no remote call, no local effect), under a
    forked RNG so the user's random stream is untouched.
    """
    cone: set[Node] = set()
    stack = list(wanted)
    while stack:
        node = stack.pop()
        if node in cone:
            continue
        if node.op != "placeholder" and not is_pure_movable(node, ops):
            continue
        cone.add(node)
        stack.extend(node.all_input_nodes)
    interpreter = torch.fx.Interpreter(gm)
    values: dict[Node, Any] = {}
    placeholders = iter(inputs)
    with forked_rng(), torch.no_grad():
        for node in gm.graph.nodes:
            if node.op == "placeholder":
                value = next(placeholders, None)
                if node in cone and value is not None:
                    values[node] = value
                continue
            if node not in cone or any(i not in values for i in node.all_input_nodes):
                continue
            args = torch.fx.node.map_arg(node.args, values.__getitem__)
            kwargs = torch.fx.node.map_arg(node.kwargs, values.__getitem__)
            try:
                values[node] = getattr(interpreter, node.op)(node.target, args, kwargs)
            except Exception:
                continue
    return values


def _request_bytes(node: Node, values: Mapping[Node, Any]) -> int | None:
    """Bytes of the tensors a request sends (its ids), from ShapeProp metadata or example values."""
    total = 0
    flat: list[Any] = []
    torch.fx.node.map_aggregate((node.args, node.kwargs), flat.append)
    for arg in flat:
        if isinstance(arg, Node):
            meta = arg.meta.get("tensor_meta")
            value = values.get(arg)
            if meta is not None and hasattr(meta, "shape"):
                total += (
                    int(torch.Size(meta.shape).numel())
                    * torch.empty((), dtype=meta.dtype).element_size()
                )
            elif isinstance(value, torch.Tensor):
                total += value.numel() * value.element_size()
            elif arg in values:
                continue  # a non-tensor value (a table name): negligible
            else:
                return None
        elif isinstance(arg, torch.Tensor):
            total += arg.numel() * arg.element_size()
    return total


def batch_fetch(gm: torch.fx.GraphModule, ctx: PassContext) -> PassResult:
    """Merge concurrent reads with a registered batched variant and equal batch key into one issue.

    Issues are concurrent when only other issues and the pure computation of issue arguments lie
    between them (as hoisting leaves them); local work, a wait, a blocking call, a conflicting
    write or a local effect ends a group. The batched issue takes the place of the group's last member; each
    member's wait then waits on the batched future (the spec's ``wait`` of it returns the list of
    results, in request order) and takes its item.

    Options (``pass_options["batch_fetch"]``):
        max_batch_requests: at most this many requests per batch.
        max_batch_bytes: at most this many request bytes (the ids sent) per batch. Bytes come from
            ``tensor_meta`` (``torch.fx.passes.shape_prop.ShapeProp``) when present, otherwise
            from evaluating the pure computation of the ids on the example inputs; a request whose
            size is unknown counts as 0 bytes.

    Before::

        fetch_issue = fetch_async('user', getitem)
        fetch_1_issue = fetch_async('item', getitem_1)
        fetch_wait = wait_fetch(fetch_issue, 'model.py:12: ...')
        fetch_1_wait = wait_fetch(fetch_1_issue, 'model.py:13: ...')

    After::

        fetch_many_async = fetch_many_async([('user', getitem), ('item', getitem_1)], [{}, {}])
        fetch_wait = wait_fetch(fetch_many_async, 'model.py:12: ...', item = 0)
        fetch_1_wait = wait_fetch(fetch_many_async, 'model.py:13: ...', item = 1)
    """
    max_requests = _limit(ctx, "max_batch_requests")
    max_bytes = _limit(ctx, "max_batch_bytes")
    graph = gm.graph
    ops = remote_ops(graph)

    def batch_key(node: Node) -> Hashable | None:
        op = ops.get(node)
        if op is None or op.kind != "issue" or op.start is not node or op.is_write:
            return None
        # Every user must be a plain wait, which the merge can point at the batched future.
        plain_waits = all(
            is_wait(u) and u.args[0] is node and u.kwargs.get("item") is None for u in node.users
        )
        if not node.users or not plain_waits:
            return None
        key = batch_key_of_call(op.spec, node.args, node.kwargs)
        return None if key is None else (id(op.spec.batched), key)

    keys = {n: k for n in graph.nodes if (k := batch_key(n)) is not None}
    values: dict[Node, Any] = {}
    if max_bytes is not None and ctx.example_inputs is not None:
        wanted = [a for n in keys for a in n.all_input_nodes]
        values = _example_values(gm, wanted, ops, ctx.example_inputs)
    unknown_sizes = 0

    # Hoisting leaves each issue right after the computation of its arguments; issues separated
    # by anything else (local work, a wait, a write) are not concurrent, and merging them would
    # delay the earlier ones.
    issue_inputs = _argument_cones(graph, ops)
    position = {n: i for i, n in enumerate(graph.nodes)}
    open_groups: dict[Hashable, _Group] = {}
    done: list[_Group] = []
    for node in list(graph.nodes):
        for key, group in list(open_groups.items()):
            if node in keys and keys[node] == key:
                continue
            adjacent = node in issue_inputs or _is_issue(node, ops)
            blocked = not adjacent or any(
                node in m.users or must_keep_order(m, node, ops) for m in group.members
            )
            if blocked:
                done.append(open_groups.pop(key))
        if node not in keys:
            continue
        key = keys[node]
        size = 0
        if max_bytes is not None:
            measured = _request_bytes(node, values)
            unknown_sizes += measured is None
            size = measured or 0
        current = open_groups.get(key)
        if current is not None and (
            (max_requests is not None and len(current.members) + 1 > max_requests)
            or (max_bytes is not None and current.nbytes + size > max_bytes)
            or not _stays_ordered([*current.members, node], ops, position)
        ):
            done.append(open_groups.pop(key))
            current = None
        if current is None:
            current = open_groups[key] = _Group(key)
        current.members.append(node)
        current.nbytes += size
    done.extend(open_groups.values())

    batches = merged = 0
    for group in done:
        if len(group.members) < 2:
            continue
        _merge(graph, group.members, ops[group.members[0]])
        batches += 1
        merged += len(group.members)
    detail = f"merged {plural(merged, 'remote read')} into {plural(batches, 'batched request')}"
    if unknown_sizes:
        detail += f" ({plural(unknown_sizes, 'request size')} unknown)"
    return PassResult(modified=batches > 0, detail=detail)


def _stays_ordered(
    members: list[Node], ops: Mapping[Node, RemoteOp], position: Mapping[Node, int]
) -> bool:
    """Whether the merged request keeps every conflicting write wholly before or after it.

    Each member alone does; merged, one member's wait may come after a write that conflicts with
    another member (a read of ``t1`` batched with a later read of ``t0``, a write of ``t1`` between
    their waits). The batched future completes as a whole, so that would be safe, but the order
    rules could no longer tell, and later passes would reorder differently on a second run.
    """
    merged = RemoteOp(
        "batch",
        members[0],
        ops[members[0]].spec,
        "read",
        tuple(r for m in members for r in ops[m].resources),
        (),
    )
    spots = [position[n] for m in members for n in (m, *m.users)]
    low, high = min(spots), max(spots)
    for other in {id(op): op for op in ops.values()}.values():
        if other.start in members or not conflicts(merged, other):
            continue
        where = [position[n] for n in other.nodes]
        if not (max(where) < low or min(where) > high):
            return False
    return True


def _argument_cones(graph: torch.fx.Graph, ops: Mapping[Node, RemoteOp]) -> set[Node]:
    """Pure nodes whose every use is (transitively) an argument of a remote issue."""
    cone: set[Node] = set()
    for node in reversed(graph.nodes):
        if not is_pure_movable(node, ops) or not node.users:
            continue
        if all(u in cone or _is_issue(u, ops) for u in node.users):
            cone.add(node)
    return cone


def _is_issue(node: Node, ops: Mapping[Node, RemoteOp]) -> bool:
    op = ops.get(node)
    return op is not None and op.start is node and op.kind in ("issue", "batch")


def _merge(graph: torch.fx.Graph, members: list[Node], op: RemoteOp) -> None:
    last = members[-1]
    assert op.spec.batched is not None
    with graph.inserting_before(last):
        batched = graph.call_function(
            op.spec.batched,
            ([tuple(m.args) for m in members], [dict(m.kwargs) for m in members]),
        )
    batched.meta["distopt_side_effect"] = True
    batched.meta[CALL_INDEX] = [m.meta.get(CALL_INDEX) for m in members]
    for item, member in enumerate(members):
        for wait in list(member.users):
            wait.update_arg(0, batched)
            wait.update_kwarg("item", item)
        graph.erase_node(member)


PASS = PassSpec(
    name="batch_fetch",
    fn=batch_fetch,
    after=("split_remote", "hoist_issue"),
    options=_OPTIONS,
    fixed_point="remote_schedule",
)
"""This module's pass, listed with the other built-ins in :mod:`distopt.passes`."""
