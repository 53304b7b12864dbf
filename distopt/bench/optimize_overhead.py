"""How long ``distopt.optimize`` itself takes on graphs of growing size (deep MLPs).

Target (issue 2): ≤ 0.5 s per 1k nodes, roughly linear growth.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
import warnings

import torch
import torch.fx
from rich.table import Table

import distopt
from distopt.bench import median
from distopt.config import check, from_dict
from distopt.console import console as make_console
from distopt.errors import CaptureError
from distopt.models.mlp import MLP


@dataclasses.dataclass(kw_only=True, slots=True)
class OverheadConfig:
    node_counts: tuple[int, ...] = (1000, 10000)
    """Approximate graph sizes to measure (an MLP layer is 2 nodes: linear + relu)."""
    repeats: int = 3
    """Timed optimize() calls per size; the median is reported."""
    width: int = 8
    verify: bool = False
    """Include verification (one extra forward/backward of both models) in the timing."""
    target_s_per_1k: float = 0.5

    def __post_init__(self) -> None:
        check(
            all(n >= 10 for n in self.node_counts), "node_counts", "sizes >= 10", self.node_counts
        )
        check(self.repeats >= 1, "repeats", "an integer >= 1", self.repeats)


def _measure(nodes: int, cfg: OverheadConfig) -> dict[str, float]:
    depth = max(1, (nodes - 3) // 2)
    model = MLP(cfg.width, cfg.width, depth, cfg.width)
    inputs = (torch.randn(2, cfg.width),)
    times = []
    graph_nodes = 0
    for _ in range(cfg.repeats):
        start = time.perf_counter()
        with warnings.catch_warnings():
            warnings.simplefilter("error", distopt.DistoptFallbackWarning)
            optimized = distopt.optimize(model, inputs, verify=cfg.verify)
        times.append(time.perf_counter() - start)
        if not isinstance(optimized, torch.fx.GraphModule):
            raise CaptureError(
                f"optimize_overhead: expected a torch.fx graph, got {type(optimized).__name__}"
            )
        graph_nodes = len(optimized.graph.nodes)
    seconds = median(times)
    return {
        "target_nodes": nodes,
        "graph_nodes": graph_nodes,
        "median_s": seconds,
        "s_per_1k_nodes": seconds / graph_nodes * 1000,
    }


def run(config: dict, args: argparse.Namespace) -> int:
    cfg = from_dict(OverheadConfig, config)
    console = make_console()
    rows = []
    for nodes in cfg.node_counts:
        console.print(f"optimize(): measuring a {nodes}-node graph ({cfg.repeats} runs)…")
        rows.append(_measure(nodes, cfg))
    table = Table(title=f"distopt.optimize overhead (verify={cfg.verify}, median of {cfg.repeats})")
    for col in ("graph nodes", "median s", "s per 1k nodes", "target"):
        table.add_column(col, justify="right")
    for row in rows:
        ok = row["s_per_1k_nodes"] <= cfg.target_s_per_1k
        table.add_row(
            str(row["graph_nodes"]),
            f"{row['median_s']:.3f}",
            f"{row['s_per_1k_nodes']:.3f}",
            f"≤{cfg.target_s_per_1k} {'ok' if ok else 'MISSED'}",
        )
    console.print(table)
    if len(rows) >= 2:
        growth = rows[-1]["median_s"] / rows[0]["median_s"]
        size = rows[-1]["graph_nodes"] / rows[0]["graph_nodes"]
        console.print(f"growth: {size:.1f}× nodes → {growth:.1f}× time (linear = {size:.1f}×)")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(
                {"kind": "optimize_overhead", "config": dataclasses.asdict(cfg), "rows": rows},
                fh,
                indent=2,
            )
    return 0 if all(r["s_per_1k_nodes"] <= cfg.target_s_per_1k for r in rows) else 1
