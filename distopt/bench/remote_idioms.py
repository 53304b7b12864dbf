"""Remote calls as users write them: how much latency distopt hides, next to a hand-written async model.

For each idiom (a module with ``build(seed, hand=False)`` and ``remote_parameters(model)``, e.g.
the corpus in ``tests/remote/corpus``) the RPC group's servers answer every request after the
injected latency, and this process trains three variants of the same model with
``dist_autograd`` and a ``DistributedOptimizer``, interleaved in rounds (the order rotates): the
model as written (blocking calls), its distopt-optimized GraphModule, and the hand-written async
model. H = (T_base − T_opt) / (T_base − T_hand) of median step times: the share of the hand-written
version's hidden latency that distopt hides too.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib
import json
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc
from rich.table import Table
from torch.distributed.optim import DistributedOptimizer

import distopt
from distopt.bench import median
from distopt.capture.tracer import resolve_qualname
from distopt.config import check, from_dict, to_dict
from distopt.console import console as make_console
from distopt.remote.local import named_local_tensors

VARIANTS = ("baseline", "optimized", "hand")


@dataclasses.dataclass(kw_only=True, slots=True)
class RemoteIdiomsConfig:
    idioms: tuple[str, ...] = ()
    """Modules with ``build(seed, hand=False)``, ``remote_parameters(model)`` (e.g.
    ``tests.remote.corpus.rref_helper``)."""
    common: str = "tests.remote.corpus.common"
    """Module with ``inputs(batch, seed)``, ``targets(batch, seed)`` and ``loss(out, target)``."""
    group: str = "tests.remote.corpus.group:rpc_group"
    """Context manager forming the RPC group: ``group(num_servers, latency_ms=...)``."""
    reads: tuple[str, ...] = ()
    """Server functions to declare reads (``distopt.register_read``) before optimizing."""
    latency_ms: float = 4.0
    num_servers: int = 2
    batch_size: int = 32
    rounds: int = 5
    steps: int = 20
    warmup: int = 3
    lr: float = 0.05
    target_hidden: float = 0.8

    def __post_init__(self) -> None:
        check(bool(self.idioms), "idioms", "at least one idiom module", self.idioms)
        check(self.latency_ms >= 0, "latency_ms", "a number >= 0", self.latency_ms)
        check(self.rounds >= 1, "rounds", "an integer >= 1", self.rounds)
        check(self.steps > self.warmup >= 0, "steps", f"an integer > warmup ({self.warmup})", self.steps)


def _train_chunk(model: torch.nn.Module, optimizer: Any, batches: list, loss: Callable) -> list[float]:
    times = []
    for (dense, ids), target in batches:
        start = time.perf_counter()
        with dist_autograd.context() as context:
            value = loss(model(dense, ids), target)
            dist_autograd.backward(context, [value])
            optimizer.step(context)
        times.append(time.perf_counter() - start)
    return times


def _idiom(bench: RemoteIdiomsConfig, name: str, common: Any) -> dict[str, Any]:
    idiom = importlib.import_module(name)
    models = {"baseline": idiom.build(seed=0), "hand": idiom.build(seed=0, hand=True)}
    twin = idiom.build(seed=0)
    example = common.inputs(bench.batch_size, seed=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error", distopt.DistoptFallbackWarning)
        start = time.perf_counter()
        models["optimized"] = distopt.optimize(twin, example, strict=True)
        optimize_s = time.perf_counter() - start
    owners = {"baseline": models["baseline"], "hand": models["hand"], "optimized": twin}
    optimizers = {
        v: DistributedOptimizer(
            torch.optim.SGD,
            [rpc.RRef(p) for _, p in named_local_tensors(m, "_parameters")] + idiom.remote_parameters(owners[v]),
            lr=bench.lr,
        )
        for v, m in models.items()
    }
    batches = [
        (common.inputs(bench.batch_size, seed=s), common.targets(bench.batch_size, seed=s))
        for s in range(bench.steps)
    ]
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for round_index in range(bench.rounds):
        order = VARIANTS[round_index % 3:] + VARIANTS[: round_index % 3]
        for variant in order:
            chunk = _train_chunk(models[variant], optimizers[variant], batches, common.loss)
            times[variant].extend(chunk[bench.warmup:])
    t_base, t_opt, t_hand = (median(times[v]) for v in VARIANTS)
    hideable = t_base - t_hand
    hidden = (t_base - t_opt) / hideable if hideable > 0.05 * t_base else None
    return {
        "idiom": name.rsplit(".", 1)[-1],
        "median_step_s": {v: median(times[v]) for v in VARIANTS},
        "step_times_s": times,
        "hidden": hidden,
        "optimize_s": optimize_s,
    }


def _table(results: list[dict[str, Any]], bench: RemoteIdiomsConfig) -> Table:
    table = Table(title=f"remote_idioms: median step ms (dist_autograd), {bench.latency_ms:g} ms server latency; "
                  "H = share of the hand-written async model's hidden latency distopt hides")
    for col in ("idiom", "baseline", "optimized", "hand", "opt speed-up", "H"):
        table.add_column(col, justify="left" if col == "idiom" else "right")
    for r in results:
        ms = {v: r["median_step_s"][v] * 1e3 for v in VARIANTS}
        h = r["hidden"]
        cell = "n/a" if h is None else (f"{h:.2f}" if h >= bench.target_hidden else f"[red]{h:.2f}[/red]")
        table.add_row(r["idiom"], *(f"{ms[v]:.2f}" for v in VARIANTS), f"{ms['baseline'] / ms['optimized']:.2f}×", cell)
    return table


def run(config: dict, args: argparse.Namespace) -> int:
    bench = from_dict(RemoteIdiomsConfig, config)
    console = make_console()
    for read in bench.reads:
        distopt.register_read(resolve_qualname(read))
    common = importlib.import_module(bench.common)
    group = resolve_qualname(bench.group)
    results = []
    with contextlib.ExitStack() as stack:
        stack.enter_context(group(bench.num_servers, latency_ms=bench.latency_ms))
        for index, name in enumerate(bench.idioms, 1):
            console.print(f"[{index}/{len(bench.idioms)}] {name}: {bench.rounds} rounds × {bench.steps} steps × 3 variants…")
            results.append(_idiom(bench, name, common))
    console.print(_table(results, bench))
    scored = [r for r in results if r["hidden"] is not None]
    missed = [r["idiom"] for r in scored if r["hidden"] < bench.target_hidden]
    console.print(f"H ≥ {bench.target_hidden} at {len(scored) - len(missed)}/{len(scored)} idioms with hideable latency"
                  + (f"; missed: {', '.join(missed)}" if missed else ""))
    if args.json:
        Path(args.json).write_text(json.dumps({"kind": "remote_idioms", "config": to_dict(bench), "results": results}, indent=2))
    return 1 if missed else 0
