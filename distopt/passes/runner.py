"""Run a pipeline of passes on one GraphModule: lint, DCE, recompile, timing, per-pass records."""

from __future__ import annotations

import difflib
import time
from collections.abc import Sequence
from typing import Any

import torch.fx

from distopt.errors import PassError
from distopt.passes.base import PassContext, PassSpec
from distopt.passes.side_effects import eliminate_dead_code
from distopt.report import GraphRecord, PassRecord


def _node_signature(node: torch.fx.Node) -> str:
    return f"{node.name}={node.op}:{node.target}"


def _count_changes(before: list[str], after: list[str]) -> int:
    matcher = difflib.SequenceMatcher(a=before, b=after, autojunk=False)
    changed = 0
    for tag, i1, i2, j1, j2 in matcher.get_opcodes():
        if tag != "equal":
            changed += max(i2 - i1, j2 - j1)
    return changed


def run_passes(
    gm: torch.fx.GraphModule,
    pipeline: Sequence[PassSpec],
    *,
    example_inputs: tuple[Any, ...] | None = None,
    pass_options: dict[str, dict[str, Any]] | None = None,
    training: bool = True,
    record: GraphRecord | None = None,
) -> GraphRecord:
    """Apply ``pipeline`` to ``gm`` in place and return what each pass changed.

    After every pass: ``graph.lint()``, dead-code elimination that keeps side-effectful nodes,
    and ``recompile()``. A pass that raises becomes a :class:`PassError` naming it and the passes
    that ran before it.
    """
    record = record or GraphRecord(code_before=gm.code)
    notes: dict[str, Any] = {}
    done: list[str] = []
    for spec in pipeline:
        before = [_node_signature(n) for n in gm.graph.nodes]
        ctx = PassContext(
            example_inputs=example_inputs,
            options=dict((pass_options or {}).get(spec.name, {})),
            training=training,
            notes=notes,
        )
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
        after = [_node_signature(n) for n in gm.graph.nodes]
        changed = _count_changes(before, after) if result.modified or removed else 0
        record.dce_removed += removed
        record.passes.append(
            PassRecord(
                name=spec.name,
                modified=bool(result.modified or removed),
                detail=result.detail,
                seconds=seconds,
                nodes_before=len(before),
                nodes_after=len(after),
                nodes_changed=changed,
            )
        )
        done.append(spec.name)
    record.code_after = gm.code
    return record
