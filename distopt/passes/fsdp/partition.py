"""Partition a graph into contiguous units balanced by parameter bytes and compute cost.

The pass only *annotates*: every node gets ``node.meta["distopt_unit"]`` and the GraphModule gets
``gm.meta["distopt_partition"]`` (a :class:`PartitionPlan`). The module tree is untouched, so
parameter FQNs and ``state_dict()`` keys stay the original model's; :func:`distopt.parallelize`
materializes the units (see :mod:`distopt.parallel.units`) only when it wraps them.

Cuts are only placed where they are harmless:

* never between two uses of the same parameter owner (tied weights stay in one unit, so one
  FSDP unit owns each parameter);
* never between a remote-call issue and its wait (nor inside a group of nodes sharing a
  ``distopt_remote_pair`` meta value), so the overlap the scheduling passes built survives;
* preferably at module boundaries ("blocks.3" → "blocks.4"), the cuts an expert writes by hand.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import torch
import torch.fx
from torch import nn

from distopt.config import from_dict
from distopt.errors import ConfigError
from distopt.estimate.profile import profile_nodes
from distopt.passes.core.pass_base import PassContext, PassResult, PassSpec
from distopt.remote.ops import remote_ops

UNIT_META = "distopt_unit"
PLAN_META = "distopt_partition"
PAIR_META = "distopt_remote_pair"


@dataclasses.dataclass(kw_only=True, slots=True)
class Unit:
    """One contiguous group of graph nodes that becomes one FSDP unit."""

    index: int
    nodes: tuple[str, ...]
    """Node names, in graph order."""
    state_names: tuple[str, ...]
    """FQNs of the parameters and buffers the unit owns (original model names)."""
    param_bytes: int
    cost: float
    """Profiled forward seconds, or the estimate (parameter elements) without example inputs
    or when a node needs the result of a remote call (the pass never sends one)."""


@dataclasses.dataclass(kw_only=True, slots=True)
class PartitionPlan:
    units: list[Unit]
    cost_source: str
    """``"profile"`` (timed run of the example inputs) or ``"estimate"``."""

    @property
    def unit_bytes(self) -> list[int]:
        return [u.param_bytes for u in self.units]

    def summary(self) -> str:
        mib = ", ".join(f"{b / 2**20:.2f}" for b in self.unit_bytes)
        return f"{len(self.units)} units (MiB: {mib}; cost: {self.cost_source})"


def tensor_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _node_state(gm: torch.fx.GraphModule, node: torch.fx.Node) -> dict[str, torch.Tensor]:
    """The parameters and buffers a node reads, by FQN (empty for pure ops)."""
    if node.op == "call_module":
        mod = gm.get_submodule(str(node.target))
        return {f"{node.target}.{k}": v for k, v in mod.state_dict(keep_vars=True).items()}
    if node.op == "get_attr":
        owner, _, attr = str(node.target).rpartition(".")
        try:
            value = getattr(gm.get_submodule(owner) if owner else gm, attr)
        except AttributeError:
            return {}
        if isinstance(value, torch.Tensor):
            return {str(node.target): value}
        if isinstance(value, nn.Module):
            return {f"{node.target}.{k}": v for k, v in value.state_dict(keep_vars=True).items()}
    return {}


def _scope(node: torch.fx.Node) -> str | None:
    """The module path a node belongs to (its own target for module calls)."""
    if node.op in ("call_module", "get_attr"):
        return str(node.target)
    stack = node.meta.get("nn_module_stack")
    if stack:
        key = list(stack.keys())[-1]
        value = stack[key]
        # Tracers store either {path: type} or {id: (path, type)}.
        if isinstance(value, tuple) and value and isinstance(value[0], str):
            return value[0]
        return str(key)
    return None


_NUMBERED = re.compile(r"^\d+$")


def block_key(path: str | None) -> str | None:
    """The repeated block a module path belongs to: ``"blocks.3.attn.qkv"`` → ``"blocks.3"``."""
    if not path:
        return None
    parts = path.split(".")
    for i, part in enumerate(parts):
        if _NUMBERED.match(part):
            return ".".join(parts[: i + 1])
    return parts[0]


def _forbidden_intervals(
    gm: torch.fx.GraphModule, nodes: list[torch.fx.Node], touched: list[set[int]]
) -> list[tuple[int, int]]:
    """Index ranges ``[a, b]`` that must not be cut (no cut before any index in ``(a, b]``).

    ``touched[i]`` holds the ids of the parameters/buffers node ``i`` uses.
    """
    pos = {n: i for i, n in enumerate(nodes)}
    ops = remote_ops(gm.graph)
    intervals: list[tuple[int, int]] = []
    first_last: dict[int, list[int]] = {}
    pairs: dict[Any, list[int]] = {}
    for i, node in enumerate(nodes):
        for tid in touched[i]:
            first_last.setdefault(tid, [i, i])[1] = i
        if PAIR_META in node.meta:
            pairs.setdefault(node.meta[PAIR_META], []).append(i)
        op = ops.get(node)
        if op is not None and node is op.start and op.kind != "call":
            # An issue (single or batched) and its waits: keep the whole span in one unit.
            intervals.append((i, max((pos[e] for e in op.ends if e in pos), default=i)))
    intervals += [(a, b) for a, b in first_last.values() if b > a]
    intervals += [(min(ix), max(ix)) for ix in pairs.values() if len(ix) > 1]
    return intervals


def _profiled_costs(
    gm: torch.fx.GraphModule, nodes: list[torch.fx.Node], example_inputs: tuple[Any, ...]
) -> list[float] | None:
    """Profiled seconds of ``nodes``, or ``None`` when the graph cannot run here.

    A pass never talks to servers: remote requests are modeled, and add no compute to balance.
    A node that needs a remote result cannot run then, and neither can a graph of meta tensors.
    """
    try:
        # Three timed runs are enough to weigh units against each other.
        seconds = profile_nodes(gm, example_inputs, repeats=3, remote_latency_s=0.0)
    except Exception:
        return None  # e.g. meta tensors: fall back to estimates
    if any(n.name not in seconds for n in nodes):
        return None
    return [seconds[n.name] for n in nodes]


def _choose_cuts_by_count(prefix: list[float], candidates: list[int], k: int) -> list[int]:
    """Up to ``k - 1`` cut positions from ``candidates`` nearest to the weight quantiles."""
    total = prefix[-1]
    cuts: list[int] = []
    for j in range(1, k):
        target = total * j / k
        # Only cuts that leave weight on both sides: no empty (pure-glue) units.
        floor = prefix[cuts[-1]] if cuts else 0.0
        later = [c for c in candidates if (not cuts or c > cuts[-1]) and floor < prefix[c] < total]
        if not later:
            break
        best = min(later, key=lambda c: abs(prefix[c] - target))
        if best not in cuts:
            cuts.append(best)
    return cuts


def _choose_cuts_by_budget(node_bytes: list[int], candidates: list[int], budget: int) -> list[int]:
    """Greedy packing: cut at a candidate when the segment up to the next one would overflow."""
    bounds = candidates + [len(node_bytes)]
    cuts: list[int] = []
    start, current = 0, 0
    for end in bounds:
        segment = sum(node_bytes[start:end])
        if current and current + segment > budget:
            cuts.append(start)
            current = 0
        current += segment
        start = end
    return cuts


@dataclasses.dataclass(kw_only=True, slots=True)
class PartitionOptions:
    num_units: int | None = None
    """Target number of units; default: one per repeated block (``blocks.N``), plus one for the
    parameters before the blocks and one for those after them."""
    max_unit_bytes: int | None = None
    """Memory budget: parameter bytes per unit (overrides ``num_units``)."""
    cost: str = "auto"
    """``"profile"``, ``"estimate"`` or ``"auto"`` (profile when the example inputs can run the
    graph without remote results, see :func:`distopt.estimate.profile.profile_nodes`)."""
    compute_weight: float = 0.5
    """Share of compute cost in the balance (the rest is parameter bytes)."""

    def __post_init__(self) -> None:
        if self.num_units is not None and self.num_units < 1:
            raise ConfigError(
                f"partition.num_units: expected an integer >= 1, got {self.num_units!r}"
            )
        if self.max_unit_bytes is not None and self.max_unit_bytes < 1:
            raise ConfigError(
                f"partition.max_unit_bytes: expected an integer >= 1, got {self.max_unit_bytes!r}"
            )
        if self.cost not in ("auto", "profile", "estimate"):
            raise ConfigError(
                f"partition.cost: expected 'auto', 'profile' or 'estimate', got {self.cost!r}"
            )
        if not 0.0 <= self.compute_weight <= 1.0:
            raise ConfigError(
                f"partition.compute_weight: expected a number in [0, 1], got {self.compute_weight!r}"
            )


def _default_unit_count(keys: list[str | None], node_bytes: list[int], num_candidates: int) -> int:
    """One unit per repeated block, plus one for the parameters before the first block and one
    for those after the last (embeddings; final norm and head) when there are any."""
    in_block = [bool(k and _NUMBERED.match(k.rsplit(".", 1)[-1])) for k in keys]
    if not any(in_block):
        return min(8, num_candidates + 1)
    first = in_block.index(True)
    last = len(in_block) - 1 - in_block[::-1].index(True)
    blocks = {k for k, b in zip(keys, in_block, strict=True) if b}
    return len(blocks) + (sum(node_bytes[:first]) > 0) + (sum(node_bytes[last + 1 :]) > 0)


def plan_partition(
    gm: torch.fx.GraphModule,
    options: PartitionOptions,
    example_inputs: tuple[Any, ...] | None = None,
) -> PartitionPlan:
    """Compute unit assignments for ``gm``'s nodes (see the module docstring for the rules)."""
    nodes = [n for n in gm.graph.nodes if n.op not in ("placeholder", "output")]
    if not nodes:
        return PartitionPlan(units=[], cost_source="estimate")
    touched: list[set[int]] = []
    states: list[dict[str, torch.Tensor]] = []
    claimed: set[int] = set()
    for node in nodes:
        state = _node_state(gm, node)
        fresh = {k: v for k, v in state.items() if id(v) not in claimed}  # first use owns it
        claimed.update(id(v) for v in fresh.values())
        touched.append({id(v) for v in state.values()})
        states.append(fresh)
    node_bytes = [
        sum(tensor_bytes(v) for v in s.values() if isinstance(v, nn.Parameter)) for s in states
    ]

    costs: list[float] | None = None
    if options.cost in ("auto", "profile") and example_inputs is not None:
        costs = _profiled_costs(gm, nodes, example_inputs)
    if options.cost == "profile" and costs is None:
        raise ConfigError(
            "partition.cost: 'profile' needs example inputs the graph can run on without remote results"
        )
    source = "estimate" if costs is None else "profile"
    if costs is None:
        costs = [b / 4.0 for b in node_bytes]

    total_b, total_c = float(sum(node_bytes)) or 1.0, float(sum(costs)) or 1.0
    cw = options.compute_weight if sum(costs) else 0.0
    weights = [
        (1 - cw) * b / total_b + cw * c / total_c for b, c in zip(node_bytes, costs, strict=True)
    ]
    prefix = [0.0]
    for w in weights:
        prefix.append(prefix[-1] + w)

    blocked: set[int] = set()
    for a, b in _forbidden_intervals(gm, nodes, touched):
        blocked.update(range(a + 1, b + 1))
    allowed = [i for i in range(1, len(nodes)) if i not in blocked]
    keys = [block_key(_scope(n)) for n in nodes]
    preferred, last_key = [], None
    for i, key in enumerate(keys):
        if key is None:
            continue
        if last_key is not None and key != last_key and i not in blocked:
            # Cut before the first node of the new scope, or earlier if unkeyed nodes precede it.
            preferred.append(i)
        last_key = key
    candidates = preferred if preferred else allowed

    if options.max_unit_bytes is not None:
        cuts = _choose_cuts_by_budget(node_bytes, candidates, options.max_unit_bytes)
    else:
        k = options.num_units
        if k is None:
            k = _default_unit_count(keys, node_bytes, len(candidates))
        cuts = _choose_cuts_by_count(prefix, candidates, k)

    bounds = [0, *sorted(set(cuts)), len(nodes)]
    units = []
    for index, (a, b) in enumerate(zip(bounds, bounds[1:], strict=False)):
        names = {k_: v for s in states[a:b] for k_, v in s.items()}
        units.append(
            Unit(
                index=index,
                nodes=tuple(n.name for n in nodes[a:b]),
                state_names=tuple(names),
                param_bytes=sum(node_bytes[a:b]),
                cost=sum(costs[a:b]),
            )
        )
    return PartitionPlan(units=units, cost_source=source)


def apply_plan(gm: torch.fx.GraphModule, plan: PartitionPlan) -> None:
    """Write the plan into node meta (placeholders join unit 0, the output the last unit)."""
    unit_of = {name: u.index for u in plan.units for name in u.nodes}
    last = max(len(plan.units) - 1, 0)
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            node.meta[UNIT_META] = 0
        elif node.op == "output":
            node.meta[UNIT_META] = last
        else:
            node.meta[UNIT_META] = unit_of[node.name]
    gm.meta[PLAN_META] = plan


def unit_of(node: torch.fx.Node, previous: int = 0) -> int:
    """A node's unit; nodes added after partitioning inherit ``previous`` (the one before them)."""
    return int(node.meta.get(UNIT_META, previous))


def partition_options(raw: dict[str, Any]) -> PartitionOptions:
    return from_dict(PartitionOptions, raw, prefix="pass_options.partition")


def partition(gm: torch.fx.GraphModule, ctx: PassContext) -> PassResult:
    """Assign every node to a contiguous unit balanced by parameter bytes and compute cost.

    Profiled costs differ slightly between processes: under a process group every rank must shard
    the same units, which :func:`distopt.parallelize` ensures by giving every rank rank 0's plan.
    The graph and module tree are unchanged; units live in node meta::

        blocks_0_ln1 = self.blocks.0.ln1(add)      # meta distopt_unit=1
        ...
        blocks_1_ln1 = self.blocks.1.ln1(add_3)    # meta distopt_unit=2
    """
    options = partition_options(ctx.options)
    plan = plan_partition(gm, options, ctx.example_inputs)
    apply_plan(gm, plan)
    return PassResult(modified=False, detail=plan.summary())


PASS = PassSpec(
    name="partition",
    fn=partition,
    default=False,
    options=tuple(f.name for f in dataclasses.fields(PartitionOptions)),
)
"""This module's pass, listed with the other built-ins in :mod:`distopt.passes`."""
