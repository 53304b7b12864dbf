"""Run a pipeline of passes on one GraphModule: lint, DCE, recompile, timing, per-pass records."""

from __future__ import annotations

import difflib
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch.fx

from distopt.errors import PassError
from distopt.passes.core.pass_base import (
    CAPTURED,
    PassContext,
    PassSpec,
    measured_seconds,
    timing_key,
)
from distopt.remote.side_effects import eliminate_dead_code
from distopt.report import GraphRecord, PassRecord

if TYPE_CHECKING:
    from distopt.estimate.ab import Measurer


def _node_signature(node: torch.fx.Node) -> str:
    return f"{node.name}={node.op}:{node.target}"


def _count_changes(before: list[str], after: list[str]) -> int:
    matcher = difflib.SequenceMatcher(a=before, b=after, autojunk=False)
    changed = 0
    for tag, i1, i2, j1, j2 in matcher.get_opcodes():
        if tag != "equal":
            changed += max(i2 - i1, j2 - j1)
    return changed


REORDERS_FLOAT = "distopt_reorders_float"
"""``node.meta`` key a pass sets on a node that computes the original math in another
floating-point order (folded weights, another layout, a fused kernel): the graph's record says so
and verification compares with ``verify.reordered_rtol``/``reordered_atol``."""

_MAX_ROUNDS = 8
"""Rounds of a fixed-point group at most (a group that still changes the graph then stops)."""


def run_passes(
    gm: torch.fx.GraphModule,
    pipeline: Sequence[PassSpec],
    *,
    example_inputs: tuple[Any, ...] | None = None,
    pass_options: dict[str, dict[str, Any]] | None = None,
    training: bool = True,
    record: GraphRecord | None = None,
    measure: Measurer | None = None,
    captured_s: float | None = None,
) -> GraphRecord:
    """Apply ``pipeline`` to ``gm`` in place and return what each pass changed.

    After every pass: ``graph.lint()``, dead-code elimination that keeps side-effectful nodes,
    and ``recompile()``. Adjacent passes of one ``fixed_point`` group run again, in order, until
    a whole round modifies nothing (as torch.fx's ``PassManager`` with ``run_checks_after_each_pass``
    and ``steps``); later rounds that change something are recorded as ``name (round k)``. A pass
    that raises becomes a :class:`PassError` naming it and the passes that ran before it.

    ``captured_s``: seconds of one call of the model ``gm`` is all of, on ``example_inputs`` (its
    verification run): a measured pass whose "without" is the graph as captured takes it as that
    graph's first sample instead of calling it (:func:`~distopt.passes.core.pass_base.captured_seconds`).
    """
    record = record or GraphRecord(code_before=gm.code)
    if captured_s is not None and example_inputs is not None:
        gm.meta[CAPTURED] = (timing_key(gm, example_inputs), captured_s)
    done: list[str] = []

    def run_one(spec: PassSpec, round_index: int) -> bool:
        before = [_node_signature(n) for n in gm.graph.nodes]
        ctx = PassContext(
            example_inputs=example_inputs,
            options=dict((pass_options or {}).get(spec.name, {})),
            training=training,
            measure=measure,
        )
        captured = gm.meta.get(CAPTURED)
        if example_inputs is None or (
            captured is not None and captured[0] != timing_key(gm, example_inputs)
        ):
            captured = None  # an earlier pass changed what the captured model computes
        start = time.perf_counter()
        try:
            result = spec.fn(gm, ctx)
            gm.graph.lint()
            removed = eliminate_dead_code(gm)
            gm.recompile()
        except Exception as err:
            ran = ", ".join(done) or "none"
            raise PassError(
                f"pass {spec.name!r} failed: {type(err).__name__}: {err} (passes run before it: {ran})",
                pass_name=spec.name,
                passes_before=tuple(done),
            ) from err
        seconds = time.perf_counter() - start
        if captured is not None and result.same_cost and not removed:
            # The captured model's timing still holds for the graph: later measured passes
            # start from it (transformers' ResNet drops its no-op shortcuts first).
            assert example_inputs is not None  # captured is None without
            gm.meta[CAPTURED] = (timing_key(gm, example_inputs), captured[1])
        after = [_node_signature(n) for n in gm.graph.nodes]
        modified = bool(result.modified or removed)
        changed = _count_changes(before, after) if modified else 0
        if round_index == 1 or modified:
            record.dce_removed += removed
            record.passes.append(
                PassRecord(
                    name=spec.name if round_index == 1 else f"{spec.name} (round {round_index})",
                    modified=modified,
                    detail=result.detail,
                    seconds=seconds,
                    nodes_before=len(before),
                    nodes_after=len(after),
                    nodes_changed=changed,
                )
            )
        if round_index == 1:
            done.append(spec.name)
        return modified

    for group in _groups(pipeline):
        changed = [run_one(spec, 1) for spec in group]
        if group[0].fixed_point is None or len(group) < 2:
            continue
        for round_index in range(2, _MAX_ROUNDS + 1):
            if not any(changed):
                break
            changed = [run_one(spec, round_index) for spec in group]
    record.code_after = gm.code
    record.reorders_float = any(n.meta.get(REORDERS_FLOAT) for n in gm.graph.nodes)
    if example_inputs is not None:
        record.measured_seconds = measured_seconds(gm, example_inputs)
    return record


def _groups(pipeline: Sequence[PassSpec]) -> list[list[PassSpec]]:
    """The pipeline cut into runs of adjacent passes sharing a fixed-point group (others alone)."""
    groups: list[list[PassSpec]] = []
    for spec in pipeline:
        if (
            groups
            and spec.fixed_point is not None
            and groups[-1][0].fixed_point == spec.fixed_point
        ):
            groups[-1].append(spec)
        else:
            groups.append([spec])
    return groups
