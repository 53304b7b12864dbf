"""Merge adjacent partition units that are too small to be worth their own collectives.

Each FSDP unit costs one all-gather (forward, again in backward) and one reduce-scatter; below a
few hundred KiB on gloo those are pure latency. The pass takes the minimum as an option:
:func:`distopt.parallelize` derives it from the measured α–β model of the process group
(:func:`distopt.estimate.collectives.min_unit_bytes`) unless the user gives one.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch.fx

from distopt.config import from_dict
from distopt.errors import ConfigError
from distopt.passes.core.pass_base import PassContext, PassResult, PassSpec
from distopt.passes.fsdp.partition import PLAN_META, PartitionPlan, Unit, apply_plan
from distopt.text import plural


@dataclasses.dataclass(kw_only=True, slots=True)
class FuseOptions:
    min_unit_bytes: int | None = None
    """Smallest unit (parameter bytes). Required: ``distopt.parallelize`` passes the size derived
    from the measured α–β model of the process group."""

    def __post_init__(self) -> None:
        if self.min_unit_bytes is None:
            raise ConfigError(
                "pass_options.fuse_units.min_unit_bytes: required (distopt.parallelize derives it "
                "from the measured α–β model of the process group)"
            )
        if self.min_unit_bytes < 0:
            raise ConfigError(
                f"fuse_units.min_unit_bytes: expected an integer >= 0, got {self.min_unit_bytes!r}"
            )


def merge_small_units(plan: PartitionPlan, min_bytes: int) -> PartitionPlan:
    """Repeatedly merge the smallest unit under ``min_bytes`` into its smaller neighbour."""
    groups = [[u] for u in plan.units]
    while len(groups) > 1:
        sizes = [sum(u.param_bytes for u in g) for g in groups]
        small = [i for i, s in enumerate(sizes) if s < min_bytes]
        if not small:
            break
        i = min(small, key=sizes.__getitem__)
        if i == 0:
            j = 1
        elif i == len(groups) - 1:
            j = i - 1
        else:
            j = i - 1 if sizes[i - 1] <= sizes[i + 1] else i + 1
        lo, hi = min(i, j), max(i, j)
        groups[lo : hi + 1] = [groups[lo] + groups[hi]]
    units = [
        Unit(
            index=index,
            nodes=tuple(n for u in g for n in u.nodes),
            state_names=tuple(s for u in g for s in u.state_names),
            param_bytes=sum(u.param_bytes for u in g),
            cost=sum(u.cost for u in g),
        )
        for index, g in enumerate(groups)
    ]
    return PartitionPlan(units=units, cost_source=plan.cost_source)


def fuse_units(gm: torch.fx.GraphModule, ctx: PassContext) -> PassResult:
    """Merge adjacent units smaller than the collective-efficient minimum size.

    Before (units by meta)::  [embed 0.1 MiB] [block0 7 MiB] [block1 7 MiB] [ln_f 6 KiB]
    After::                   [embed + block0]                [block1 + ln_f]
    """
    options = from_dict(FuseOptions, dict(ctx.options), prefix="pass_options.fuse_units")
    plan: Any = gm.meta.get(PLAN_META)
    if not isinstance(plan, PartitionPlan):
        raise ConfigError("fuse_units: the graph has no partition (run the 'partition' pass first)")
    assert options.min_unit_bytes is not None  # FuseOptions requires it
    fused = merge_small_units(plan, options.min_unit_bytes)
    apply_plan(gm, fused)
    merged = len(plan.units) - len(fused.units)
    return PassResult(
        modified=False,
        detail=f"merged {plural(merged, 'unit')} below {options.min_unit_bytes / 2**20:.2f} MiB: {fused.summary()}",
    )


PASS = PassSpec(
    name="fuse_units",
    fn=fuse_units,
    after=("partition",),
    default=False,
    options=tuple(f.name for f in dataclasses.fields(FuseOptions)),
)
"""This module's pass, listed with the other built-ins in :mod:`distopt.passes`."""
