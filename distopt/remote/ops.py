"""What the remote-call scheduling passes share: which nodes are remote operations, which pairs of
nodes must keep their order, and how to reorder a graph (the wait helper the graphs call is in
:mod:`distopt.remote.wait`).

A *remote operation* is a blocking call node, or an issue node (single or batched) together with
its waits. Its effect (read/write) and resources come from the registry
(:mod:`distopt.remote.registry`), so the passes work for any registered function.

Ordering rule, used by every pass (``must_keep_order``): two nodes may swap unless
 * either is a *local barrier* — an effectful node that is not a remote operation (in-place ops,
   ``setitem``, functions marked side-effectful): nothing crosses it, because it may mutate what
   the other reads;
 * both are *stateful* — modules, buffer reads and random ops keep their relative order, so
   random-number consumption and module state are unchanged;
 * they belong to two remote operations that conflict (not both reads, and equal resources or
   an unknown resource): every node of the earlier one stays before every node of the later one,
   so a read is never moved above a write it conflicts with and writes never overtake each other;
 * they are the issues of two writes (writes keep their relative order even on other resources).
"""

from __future__ import annotations

import heapq
import operator
import re
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx
from torch.fx import Node

from distopt.remote import registry
from distopt.remote.graph_args import MISSING, attr_value
from distopt.remote.record import RemoteWrite, remote_write
from distopt.remote.registry import Effect, RemoteCallSpec
from distopt.remote.side_effects import is_impure
from distopt.remote.wait import source_line

# --------------------------------------------------------------------------- remote operations


class _Unknown:
    """Stands for a graph value when asking a registry function about a node's arguments."""

    def __repr__(self) -> str:
        return "<distopt:unknown>"

    __str__ = __repr__


_UNKNOWN = _Unknown()


def _contains_unknown(value: Any) -> bool:
    if value is _UNKNOWN or isinstance(value, Node):
        return True
    if isinstance(value, str):
        return str(_UNKNOWN) in value
    if isinstance(value, (tuple, list, frozenset, set)):
        return any(_contains_unknown(v) for v in value)
    if isinstance(value, Mapping):
        return any(_contains_unknown(k) or _contains_unknown(v) for k, v in value.items())
    return False


def _hide_nodes(args: Any) -> Any:
    """Arguments as the registry sees them: constants (also those read by get_attr, such as the
    function passed to ``rpc_sync``) stay; values computed by the graph become ``_UNKNOWN``."""

    def constant(a: Any) -> Any:
        if not isinstance(a, Node):
            return a
        value = attr_value(a)
        return _UNKNOWN if value is MISSING or isinstance(value, torch.Tensor) else value

    return torch.fx.node.map_aggregate(args, constant)


def effect_of_call(spec: RemoteCallSpec, args: Sequence[Any], kwargs: Mapping[str, Any]) -> Effect:
    """The call's effect; ``"write"`` when the registry cannot tell from constant arguments."""
    try:
        effect = registry.effect_of(spec, _hide_nodes(tuple(args)), _hide_nodes(dict(kwargs)))
    except Exception:
        return "write"
    return effect if effect in ("read", "write") else "write"


def resource_of_call(
    spec: RemoteCallSpec, args: Sequence[Any], kwargs: Mapping[str, Any]
) -> Hashable | None:
    """The call's resource; ``None`` (conflicts with everything) when it depends on graph values."""
    try:
        resource = registry.resource_of(spec, _hide_nodes(tuple(args)), _hide_nodes(dict(kwargs)))
        hash(resource)
    except Exception:
        return None
    return None if _contains_unknown(resource) else resource


def batch_key_of_call(
    spec: RemoteCallSpec, args: Sequence[Any], kwargs: Mapping[str, Any]
) -> Hashable | None:
    """The call's batch key, or ``None`` when it cannot be batched (no key, or it needs graph values)."""
    if spec.batched is None or spec.batch_key is None:
        return None
    try:
        key = spec.batch_key(_hide_nodes(tuple(args)), _hide_nodes(dict(kwargs)))
        hash(key)
    except Exception:
        return None
    return None if _contains_unknown(key) else key


@dataclass(eq=False)
class RemoteOp:
    """One remote operation: a blocking call, or an issue (single or batched) and its waits."""

    kind: str
    """``"call"`` (blocking), ``"issue"`` or ``"batch"``."""
    start: Node
    spec: RemoteCallSpec
    effect: Effect
    resources: tuple[Hashable | None, ...]
    """One per request; ``None`` means unknown (conflicts with every remote call)."""
    ends: tuple[Node, ...]
    """Nodes after which the operation is complete: its waits (the call node itself if blocking)."""

    @property
    def nodes(self) -> tuple[Node, ...]:
        return (self.start, *[n for n in self.ends if n is not self.start])

    @property
    def is_write(self) -> bool:
        return self.effect == "write"


def conflicts(a: RemoteOp, b: RemoteOp) -> bool:
    """True when ``a`` and ``b`` must not overlap or swap: not both reads, and a shared resource."""
    if a.effect == "read" and b.effect == "read":
        return False
    return any(ra is None or rb is None or ra == rb for ra in a.resources for rb in b.resources)


def _specs_by(attribute: str) -> dict[int, list[RemoteCallSpec]]:
    found: dict[int, list[RemoteCallSpec]] = {}
    for spec in registry.registered_specs():
        fn = getattr(spec, attribute)
        if fn is not None:
            found.setdefault(id(fn), []).append(spec)
    return found


def _single_view(
    node: Node, specs: list[RemoteCallSpec]
) -> tuple[RemoteCallSpec, Effect, Hashable | None]:
    spec = specs[-1]
    effects = {effect_of_call(s, node.args, node.kwargs) for s in specs}
    resources = {resource_of_call(s, node.args, node.kwargs) for s in specs}
    # Two registrations sharing one async function: assume the worse of what they declare.
    effect: Effect = "write" if "write" in effects else "read"
    resource = resources.pop() if len(resources) == 1 else None
    return spec, effect, resource


def remote_ops(graph: torch.fx.Graph) -> dict[Node, RemoteOp]:
    """Map every node that belongs to a remote operation (call, issue, batch, wait) to it."""
    calls, issues, batches = _specs_by("fn"), _specs_by("issue"), _specs_by("batched")
    result: dict[Node, RemoteOp] = {}
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        key = id(node.target)
        if key in calls:
            spec, effect, resource = _single_view(node, calls[key])
            result[node] = RemoteOp("call", node, spec, effect, (resource,), (node,))
        elif key in issues:
            spec, effect, resource = _single_view(node, issues[key])
            result[node] = RemoteOp("issue", node, spec, effect, (resource,), tuple(node.users))
        elif key in batches and len(node.args) >= 1 and isinstance(node.args[0], (list, tuple)):
            spec = batches[key][-1]
            arg_lists = node.args[0]
            kwarg_lists = node.args[1] if len(node.args) > 1 else [{}] * len(arg_lists)
            resources = tuple(
                resource_of_call(spec, a, k) for a, k in zip(arg_lists, kwarg_lists, strict=False)
            )
            result[node] = RemoteOp(
                "batch", node, spec, "read", resources or (None,), tuple(node.users)
            )
    for op in list(result.values()):
        for end in op.ends:
            result.setdefault(end, op)
    return result


def remote_write_of(op: RemoteOp) -> RemoteWrite:
    """What a graph's remote write sends, named for messages (the user's line, the server
    function when nothing declares it)."""
    node = op.start
    return remote_write(
        op.spec, _hide_nodes(tuple(node.args)), _hide_nodes(dict(node.kwargs)), source_line(node)
    )


def is_local_barrier(node: Node, ops: Mapping[Node, RemoteOp]) -> bool:
    """An effectful node that is not part of a remote operation: nothing moves across it."""
    return node.op not in ("placeholder", "output") and node not in ops and is_impure(node)


_RANDOM = re.compile(
    r"rand|dropout|bernoulli|multinomial|normal|poisson|uniform|exponential|geometric|cauchy|rrelu"
)


def is_stateful(node: Node) -> bool:
    """Modules, buffer reads and random ops: these keep their relative order."""
    if node.op == "call_module":
        return True
    if node.op == "get_attr":
        # Buffers may be updated by modules (BatchNorm statistics); functions and parameters
        # are constant during a forward pass.
        value = attr_value(node)
        return value is MISSING or (
            isinstance(value, torch.Tensor) and not isinstance(value, torch.nn.Parameter)
        )
    if node.op in ("call_function", "call_method"):
        name = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", "")
        return bool(_RANDOM.search(str(name)))
    return False


def must_keep_order(x: Node, y: Node, ops: Mapping[Node, RemoteOp]) -> bool:
    """True when nodes ``x`` and ``y`` (in either order) must not swap (see the module docstring)."""
    a, b = ops.get(x), ops.get(y)
    if a is not None and b is not None:
        if a is b:
            return False
        if conflicts(a, b):
            return True
        return a.is_write and b.is_write and x is a.start and y is b.start
    if is_local_barrier(x, ops) or is_local_barrier(y, ops):
        return True
    # Remote nodes are ordered by the rules above only; they are never "stateful".
    return a is None and b is None and is_stateful(x) and is_stateful(y)


def ordering_edges(nodes: Sequence[Node], ops: Mapping[Node, RemoteOp]) -> dict[Node, set[Node]]:
    """Predecessors each node must keep besides its inputs: ``must_keep_order`` as forward edges.

    Every edge points forward in ``nodes``, so the current order always satisfies them.
    """
    edges: dict[Node, set[Node]] = {n: set() for n in nodes}
    last_barrier: Node | None = None
    since_barrier: list[Node] = []
    last_stateful: Node | None = None
    remote = _RemoteIndex()
    for node in nodes:
        if node.op in ("placeholder", "output"):
            continue
        if is_local_barrier(node, ops):
            edges[node].update(since_barrier)
            if last_barrier is not None:
                edges[node].add(last_barrier)
            last_barrier, since_barrier = node, []
        else:
            if last_barrier is not None:
                edges[node].add(last_barrier)
            since_barrier.append(node)
        if node in ops:
            edges[node].update(remote.add(node, ops[node]))
        elif is_stateful(node):
            if last_stateful is not None:
                edges[node].add(last_stateful)
            last_stateful = node
    return edges


class _RemoteIndex:
    """Remote nodes seen so far, indexed by resource, to find conflicts without comparing all pairs."""

    def __init__(self) -> None:
        self.nodes: dict[RemoteOp, list[Node]] = {}
        self.ops: list[RemoteOp] = []
        self.unknown: list[RemoteOp] = []
        self.reads: dict[Hashable, list[RemoteOp]] = {}
        self.writes: dict[Hashable, list[RemoteOp]] = {}
        self.last_write_start: Node | None = None

    def add(self, node: Node, op: RemoteOp) -> set[Node]:
        """Earlier remote nodes ``node`` must follow; then remember ``node``."""
        preds: set[Node] = set()
        if None in op.resources:
            candidates = self.ops
        else:
            candidates = list(self.unknown)
            for resource in op.resources:
                candidates += self.writes.get(resource, [])
                if op.is_write:
                    candidates += self.reads.get(resource, [])
        for other in candidates:
            if other is not op and conflicts(other, op):
                preds.update(self.nodes[other])
        if op.is_write and node is op.start:
            # Writes keep their order: a chain through the write issues orders them all.
            if self.last_write_start is not None:
                preds.add(self.last_write_start)
            self.last_write_start = node
        if op not in self.nodes:
            self.nodes[op] = []
            self.ops.append(op)
            if None in op.resources:
                self.unknown.append(op)
            for resource in set(op.resources) - {None}:
                (self.writes if op.is_write else self.reads).setdefault(resource, []).append(op)
        self.nodes[op].append(node)
        return preds


# --------------------------------------------------------------------------- moving nodes


def move_before(nodes: Iterable[Node], target: Node) -> None:
    """Move ``nodes`` (in the given order) to just before ``target``."""
    for node in nodes:
        if node is not target:
            target.prepend(node)


def reorder(graph: torch.fx.Graph, order: Sequence[Node]) -> bool:
    """Put the graph's nodes in ``order`` (every node but the output); return whether it changed."""
    current = [n for n in graph.nodes if n.op != "output"]
    if current == list(order):
        return False
    move_before(order, graph.output_node())
    return True


def schedule(
    nodes: Sequence[Node],
    extra_preds: Mapping[Node, set[Node]],
    priority: Callable[[Node], int],
    on_scheduled: Callable[[Node], Iterable[Node]] | None = None,
) -> list[Node]:
    """Topological order of ``nodes``: always the ready node with the lowest (priority, position).

    ``priority`` is asked when a node becomes ready; ``on_scheduled(node)`` may name nodes whose
    priority has just changed, and those already ready are queued again. Ties keep the current
    order, so scheduling an already scheduled graph changes nothing.
    """
    position = {n: i for i, n in enumerate(nodes)}
    waiting: dict[Node, int] = {}
    users: dict[Node, list[Node]] = {n: [] for n in nodes}
    for node in nodes:
        preds = {p for p in node.all_input_nodes if p in position} | extra_preds.get(node, set())
        waiting[node] = len(preds)
        for p in preds:
            users[p].append(node)
    heap = [(priority(n), position[n]) for n in nodes if waiting[n] == 0]
    heapq.heapify(heap)
    order: list[Node] = []
    done: set[Node] = set()
    while heap:
        _, i = heapq.heappop(heap)
        node = nodes[i]
        if node in done:
            continue  # an older queue entry of a node whose priority changed
        order.append(node)
        done.add(node)
        for user in users[node]:
            waiting[user] -= 1
            if waiting[user] == 0:
                heapq.heappush(heap, (priority(user), position[user]))
        for changed in on_scheduled(node) if on_scheduled else ():
            if changed not in done and waiting.get(changed) == 0:
                heapq.heappush(heap, (priority(changed), position[changed]))
    if len(order) != len(nodes):  # cannot happen: every edge points forward in ``nodes``
        raise RuntimeError("remote scheduling: ordering constraints form a cycle")
    return order


def is_pure_movable(node: Node, ops: Mapping[Node, RemoteOp]) -> bool:
    """A node a pass may move for free: computation without effects that is no remote operation."""
    return (
        node.op in ("call_function", "call_method", "call_module", "get_attr")
        and node not in ops
        and not is_local_barrier(node, ops)
        and node.target is not operator.setitem
    )


def issue_cone(issue: Node, ops: Mapping[Node, RemoteOp]) -> set[Node]:
    """Pure nodes computing an issue's arguments (e.g. ids sliced from an input)."""
    cone: set[Node] = set()
    stack = list(issue.all_input_nodes)
    while stack:
        node = stack.pop()
        if node in cone or not is_pure_movable(node, ops):
            continue
        cone.add(node)
        stack.extend(node.all_input_nodes)
    return cone
