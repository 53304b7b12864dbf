"""Training steps with regional compile in ``distopt.parallelize`` against whole-model compile.

Two models: the GPT of ``fsdp_partition`` (112M parameters) and a third-party conv net (the
transformers library's ConvNeXt-T, or a ResNet, built from its config with random weights). Each goes through
``distopt.parallelize`` with the same strategy in every variant (one gloo rank by default):

* ``eager`` — no compile;
* ``whole`` — ``compile=True, compile_regions=False``: the whole module compiled (DDP compiles its
  root), Inductor defaults;
* ``regional`` — ``compile=True``: each repeated block compiled once per distinct structure
  (:mod:`distopt.parallel.regions`), the parts outside the blocks per unit or eager.

The conv net keeps ``parallelize``'s default NCHW layout, or runs channels-last in every variant
with ``channels_last: true`` (regional compile then measured 0.83× the whole model's speed, where
eager ran 1.08×: Inductor's separately compiled blocks lose with NHWC activations; not yet
understood, docs/fusion.md). Every run is a fresh process with a fresh Inductor cache
directory (nothing compiled earlier helps), rounds go round-robin over the variants, tables quote
medians. Compile time is the first step's time less the median
of the following steps. Inductor's CPU vector-ISA probe, a fact about the machine that a fresh
cache directory would make every run pay again, runs before the model is built
(:func:`distopt.bench._inductor.probe_inductor_cpu`; its seconds are in the JSON as
``isa_probe_s``).

Targets (issue 26): regional ≥ ``target_speed``× the whole-model step speed, with
≤ ``target_compile_ratio``× its compile time.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from rich.table import Table
from torch import nn

import distopt
from distopt.bench import median
from distopt.bench._inductor import probe_inductor_cpu
from distopt.config import check, from_dict, to_dict
from distopt.console import console as make_console
from distopt.dist.rendezvous import StorePlan, init_gloo, spawned_gloo
from distopt.models import build

VARIANTS = ("eager", "whole", "regional")


@dataclasses.dataclass(kw_only=True, slots=True)
class GptSize:
    vocab_size: int = 8192
    dim: int = 768
    heads: int = 12
    layers: int = 14
    seq_len: int = 64
    batch_size: int = 1


@dataclasses.dataclass(kw_only=True, slots=True)
class ConvNetSize:
    """A transformers conv net from its config: ConvNeXt-T's shape by default."""

    architecture: str = "convnext"
    """``convnext`` (``ConvNextConfig``) or ``resnet`` (``ResNetConfig``)."""
    depths: tuple[int, ...] = (3, 3, 9, 3)
    hidden_sizes: tuple[int, ...] = (96, 192, 384, 768)
    layer_type: str = "bottleneck"
    """ResNet only: ``basic`` or ``bottleneck``."""
    image_size: int = 64
    batch_size: int = 8
    num_labels: int = 10

    def __post_init__(self) -> None:
        check(
            self.architecture in ("convnext", "resnet"),
            "convnet.architecture",
            "'convnext' or 'resnet'",
            self.architecture,
        )


@dataclasses.dataclass(kw_only=True, slots=True)
class RegionalCompileConfig:
    models: tuple[str, ...] = ("gpt", "convnet")
    gpt: GptSize = dataclasses.field(default_factory=GptSize)
    convnet: ConvNetSize = dataclasses.field(default_factory=ConvNetSize)
    strategy: Literal["ddp", "fsdp"] = "ddp"
    """The same wrapper for every variant (whole-model compile needs one module to compile)."""
    channels_last: bool = False
    """The conv net runs channels-last (``parallelize(channels_last=True)``)."""
    steps: int = 10
    """Timed steps per run after the first (compiling) one."""
    rounds: int = 3
    """Fresh-process runs per variant, round-robin."""
    threads: int = 0
    """Intra-op threads (0: torch's default, all cores)."""
    variants: tuple[str, ...] = VARIANTS
    target_speed: float = 0.97
    target_compile_ratio: float = 0.5

    def __post_init__(self) -> None:
        for name in self.models:
            check(name in ("gpt", "convnet"), "models", "'gpt' and/or 'convnet'", name)
        for name in self.variants:
            check(name in VARIANTS, "variants", f"names among {', '.join(VARIANTS)}", name)
        check(self.strategy in ("ddp", "fsdp"), "strategy", "'ddp' or 'fsdp'", self.strategy)
        check(self.steps >= 1, "steps", "an integer >= 1", self.steps)
        check(self.rounds >= 1, "rounds", "an integer >= 1", self.rounds)


def _build(cfg: RegionalCompileConfig, name: str) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    """The model, one batch of inputs and targets."""
    gen = torch.Generator().manual_seed(1)
    torch.manual_seed(0)
    if name == "gpt":
        g = cfg.gpt
        gpt = build(
            "gpt",
            vocab_size=g.vocab_size,
            dim=g.dim,
            heads=g.heads,
            layers=g.layers,
            seq_len=g.seq_len,
            dropout=0.0,
        )
        idx = torch.randint(0, g.vocab_size, (g.batch_size, g.seq_len), generator=gen)
        return gpt, idx, idx
    import transformers  # optional (distopt[coverage]): only the convnet arm needs it

    c = cfg.convnet
    labels: dict[str, Any] = {"num_labels": c.num_labels}  # a PretrainedConfig keyword
    if c.architecture == "convnext":
        model: nn.Module = transformers.ConvNextForImageClassification(
            transformers.ConvNextConfig(
                depths=list(c.depths),
                hidden_sizes=list(c.hidden_sizes),
                image_size=c.image_size,
                **labels,
            )
        )
    else:
        model = transformers.ResNetForImageClassification(
            transformers.ResNetConfig(
                layer_type=c.layer_type,
                depths=list(c.depths),
                hidden_sizes=list(c.hidden_sizes),
                **labels,
            )
        )
    x = torch.randn(c.batch_size, 3, c.image_size, c.image_size, generator=gen)
    return model, x, torch.randint(0, c.num_labels, (c.batch_size,), generator=gen)


def _loss(name: str, out: Any, target: torch.Tensor) -> torch.Tensor:
    logits = out.logits if hasattr(out, "logits") else out
    if name == "gpt":
        return nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten())
    return nn.functional.cross_entropy(logits, target)


def _worker(
    rank: int, cfg_dict: dict[str, Any], name: str, variant: str, plan: StorePlan, out: str
) -> None:
    cfg = from_dict(RegionalCompileConfig, cfg_dict)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="distopt-bench-inductor-")
    probe_s = probe_inductor_cpu()
    init_gloo(plan, me="rank0", rank=0, world_size=1, timeout_s=120.0)
    try:
        model, x, target = _build(cfg, name)
        options: dict[str, Any] = {
            "compile": variant != "eager",
            "compile_regions": variant == "regional",
        }
        if name == "convnet":
            options["channels_last"] = cfg.channels_last
        start = time.perf_counter()
        wrapped = distopt.parallelize(
            model, cfg.strategy, example_inputs=(x,), verify=False, **options
        )
        setup_s = time.perf_counter() - start
        record = distopt.parallel.timing_of(wrapped)
        opt = torch.optim.SGD(wrapped.parameters(), lr=1e-3)
        times = []
        for _ in range(1 + cfg.steps):
            begin = time.perf_counter()
            loss = _loss(name, wrapped(x), target)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            times.append(time.perf_counter() - begin)
        step_s = statistics.median(times[1:])
        Path(out).write_text(
            json.dumps(
                {
                    "step_s": step_s,
                    "first_step_s": times[0],
                    "compile_s": max(0.0, times[0] - step_s),
                    "setup_s": setup_s,
                    "regions": record.regions if record else 0,
                    "isa_probe_s": probe_s,
                    "loss": loss.item(),
                }
            )
        )
    finally:
        dist.destroy_process_group()


def _run(cfg: RegionalCompileConfig, name: str, variant: str) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp, spawned_gloo() as plan:
        out = os.path.join(tmp, "result.json")
        mp.spawn(_worker, args=(to_dict(cfg), name, variant, plan, out), nprocs=1, join=True)
        result: dict[str, Any] = json.loads(Path(out).read_text())
        return result


def run(config: dict, args: argparse.Namespace) -> int:
    cfg = from_dict(RegionalCompileConfig, config)
    console = make_console()
    rows: dict[str, dict[str, Any]] = {}
    for name in cfg.models:
        runs: dict[str, list[dict[str, Any]]] = {v: [] for v in cfg.variants}
        for r in range(cfg.rounds):
            for variant in cfg.variants:
                console.print(f"{name}, round {r + 1}/{cfg.rounds}: {variant}…")
                runs[variant].append(_run(cfg, name, variant))
        rows[name] = {
            variant: {
                key: median([x[key] for x in results])
                for key in (
                    "step_s",
                    "first_step_s",
                    "compile_s",
                    "setup_s",
                    "regions",
                    "isa_probe_s",
                )
            }
            for variant, results in runs.items()
        }
    table = Table(
        title=f"training step, {cfg.strategy}, fresh process per run (median of {cfg.rounds})"
    )
    for col in (
        "model",
        "variant",
        "regions",
        "step s",
        "speed vs whole",
        "compile s",
        "compile vs whole",
        "parallelize s",
    ):
        table.add_column(col, justify="left" if col in ("model", "variant") else "right")
    ok = True
    ratios: dict[str, dict[str, float]] = {}
    for name, variants in rows.items():
        whole = variants.get("whole")
        for variant, row in variants.items():
            speed = whole["step_s"] / row["step_s"] if whole else float("nan")
            compile_ratio = (
                row["compile_s"] / whole["compile_s"]
                if whole and whole["compile_s"] > 0
                else float("nan")
            )
            table.add_row(
                name,
                variant,
                f"{row['regions']:.0f}",
                f"{row['step_s']:.3f}",
                f"{speed:.2f}×",
                f"{row['compile_s']:.1f}",
                f"{compile_ratio:.2f}",
                f"{row['setup_s']:.1f}",
            )
        if whole and "regional" in variants:
            speed = whole["step_s"] / variants["regional"]["step_s"]
            compile_ratio = variants["regional"]["compile_s"] / max(whole["compile_s"], 1e-9)
            ratios[name] = {
                "regional_speed_vs_whole": speed,
                "regional_compile_vs_whole": compile_ratio,
            }
            ok = ok and speed >= cfg.target_speed and compile_ratio <= cfg.target_compile_ratio
    console.print(table)
    console.print(
        f"targets: regional ≥ {cfg.target_speed}× whole-model step speed at ≤ {cfg.target_compile_ratio}× "
        f"its compile time: {'ok' if ok else 'MISSED'}"
    )
    if getattr(args, "json", None):
        with open(args.json, "w") as fh:
            json.dump(
                {
                    "config": to_dict(cfg),
                    "rows": rows,
                    "ratios": ratios,
                    "target_met": ok,
                    "load_average": os.getloadavg()[0],
                },
                fh,
                indent=2,
            )
    return 0 if ok else 1
