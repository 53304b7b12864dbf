"""Every model of ``distopt coverage``, in eval mode: default ``distopt.optimize`` vs eager speed.

The coverage corpus (:mod:`distopt.coverage.corpus`: transformers and deepctr-torch models built
from configs) checks that distopt returns a correct model; this benchmark checks that, by
default, it never returns a slower one. Per model: ``distopt.optimize(model.eval(), inputs)``,
then the original and the result called in interleaved rounds (``no_grad``) until each has
``min_seconds`` of calls (or ``max_rounds``); medians, timed as distopt's measurements time
(:func:`distopt.estimate.ab.default_clock`). A model distopt returned unoptimized counts as it is
(the original).

Target (issue 26): optimized ≥ ``target``× eager for every model.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
from rich.table import Table

import distopt
from distopt.bench import median
from distopt.config import check, from_dict, to_dict
from distopt.console import console as make_console
from distopt.coverage import corpus
from distopt.estimate.ab import default_clock
from distopt.report import report_of


@dataclasses.dataclass(kw_only=True, slots=True)
class CoverageSpeedConfig:
    models: tuple[str, ...] = ()
    """Corpus entries to run (default: every available one)."""
    threads: int = 0
    """Intra-op threads (0: torch's default)."""
    min_seconds: float = 1.0
    """Timed seconds per variant and model, at least."""
    max_rounds: int = 2000
    warmup: int = 5
    target: float = 0.98

    def __post_init__(self) -> None:
        check(self.min_seconds > 0, "min_seconds", "a number > 0", self.min_seconds)
        check(self.max_rounds >= 1, "max_rounds", "an integer >= 1", self.max_rounds)


def _row(entry: Any, cfg: CoverageSpeedConfig) -> dict[str, Any]:
    torch.manual_seed(0)
    model, inputs = entry.build()
    model.eval()
    start = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        optimized = distopt.optimize(model, inputs)
    optimize_s = time.perf_counter() - start
    report = report_of(optimized)
    variants: dict[str, Callable[[], object]] = {
        "eager": functools.partial(model, *inputs),
        "distopt": functools.partial(optimized, *inputs),
    }
    samples: dict[str, list[float]] = {name: [] for name in variants}
    with torch.no_grad():
        for call in variants.values():
            for _ in range(cfg.warmup):
                call()
        spent = dict.fromkeys(variants, 0.0)
        rounds = 0
        while rounds < cfg.max_rounds and min(spent.values()) < cfg.min_seconds:
            order = list(variants) if rounds % 2 == 0 else list(reversed(variants))
            for name in order:
                elapsed = default_clock(name, variants[name])
                samples[name].append(elapsed)
                spent[name] += elapsed
            rounds += 1
    times = {name: median(values) for name, values in samples.items()}
    kept: list[str] = []
    if report is not None and optimized is not model:
        kept = sorted({rec.name for graph in report.graphs for rec in graph.passes if rec.modified})
    return {
        "model": entry.name,
        "tier": report.tier if report else "",
        "returned": "original" if optimized is model else "optimized",
        "median_s": times,
        "rounds": rounds,
        "speedup": times["eager"] / times["distopt"],
        "optimize_s": optimize_s,
        "passes_changed": kept,
        "speed_check": report.speed if report else None,
    }


def run(config: dict, args: argparse.Namespace) -> int:
    cfg = from_dict(CoverageSpeedConfig, config)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    console = make_console()
    entries = [e for e in corpus() if e.available and (not cfg.models or e.name in cfg.models)]
    rows = []
    for entry in entries:
        console.print(f"{entry.name}…")
        rows.append(_row(entry, cfg))
    table = Table(
        title=f"eval mode, {torch.get_num_threads()} threads, medians of interleaved calls"
    )
    for col in (
        "model",
        "tier",
        "returned",
        "eager ms",
        "distopt ms",
        "speedup",
        "rounds",
        "passes that changed it",
    ):
        table.add_column(
            col,
            justify="right" if col in ("eager ms", "distopt ms", "speedup", "rounds") else "left",
        )
    for row in rows:
        t = row["median_s"]
        table.add_row(
            row["model"],
            row["tier"],
            row["returned"],
            f"{t['eager'] * 1e3:.3f}",
            f"{t['distopt'] * 1e3:.3f}",
            f"{row['speedup']:.2f}×",
            str(row["rounds"]),
            ", ".join(row["passes_changed"]) or "–",
        )
    console.print(table)
    slow = [row["model"] for row in rows if row["speedup"] < cfg.target]
    ok = not slow
    console.print(
        f"target: every model ≥ {cfg.target}× eager: {'ok' if ok else 'MISSED (' + ', '.join(slow) + ')'}"
    )
    if getattr(args, "json", None):
        with open(args.json, "w") as fh:
            json.dump(
                {
                    "config": to_dict(cfg),
                    "rows": rows,
                    "target_met": ok,
                    "load_average": os.getloadavg()[0],
                },
                fh,
                indent=2,
            )
    return 0 if ok else 1
