"""Run ``distopt.optimize`` over the corpus and check every returned model independently."""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

import distopt
from distopt.coverage.corpus import CorpusEntry
from distopt.remote.isolation import forked_rng
from distopt.report import report_of


@dataclass
class CoverageRow:
    name: str
    domain: str
    library: str
    tier: str
    graphs: int
    passes_changed: int
    """Passes that changed at least one graph."""
    outcome: str
    """``verified``, ``fallback`` or ``SILENTLY WRONG``."""
    reason: str
    seconds: float


def _outputs(model: nn.Module, inputs: tuple[Any, ...], seed: int) -> list[torch.Tensor]:
    with forked_rng():
        torch.manual_seed(seed)
        flat, _ = tree_flatten(model(*inputs))
    return [t.detach() for t in flat if isinstance(t, torch.Tensor)]


def _same(model: nn.Module, result: nn.Module, inputs: tuple[Any, ...]) -> bool:
    """Outputs agree in train mode (same dropout masks) and in eval mode."""
    modes = []
    for training in (True, False):
        model.train(training)
        result.train(training)
        ref, got = _outputs(model, inputs, 7), _outputs(result, inputs, 7)
        modes.append(
            len(ref) == len(got)
            and all(
                a.shape == b.shape and torch.allclose(a, b, rtol=1e-5, atol=1e-6)
                for a, b in zip(ref, got, strict=True)
            )
        )
    model.train()
    result.train()
    return all(modes)


def check_model(entry: CorpusEntry) -> CoverageRow:
    torch.manual_seed(0)
    model, inputs = entry.build()
    model.train()
    start = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = distopt.optimize(model, inputs)
    seconds = time.perf_counter() - start
    report = report_of(result)
    assert report is not None
    changed = {rec.name for graph in report.graphs for rec in graph.passes if rec.modified}
    if result is model:
        outcome, reason = "fallback", report.fallback or ""
    elif _same(model, result, inputs):
        outcome, reason = "verified", report.reason or ""
    else:
        outcome, reason = "SILENTLY WRONG", "outputs differ from the original model"
    return CoverageRow(
        name=entry.name,
        domain=entry.domain,
        library=entry.library,
        tier=report.tier,
        graphs=len(report.graphs),
        passes_changed=len(changed),
        outcome=outcome,
        reason=reason,
        seconds=seconds,
    )


def run_corpus(entries: list[CorpusEntry], progress: Any = None) -> list[CoverageRow]:
    rows = []
    for entry in entries:
        if progress is not None:
            progress(entry)
        rows.append(check_model(entry))
    return rows
