"""Default ``distopt.optimize`` on third-party conv nets against eager and ``torch.compile``.

The transformers library's ResNet-50 and ConvNeXt-T, built from their configs with random
weights (no downloads), eval mode, at each thread count: eager, ``distopt.optimize(model, x)``
with the default passes, and ``torch.compile`` (Inductor defaults, compiled cold: a fresh cache
directory per compile). Variants are timed in interleaved rounds in one process; tables quote
medians. Optimize time is the whole ``distopt.optimize`` call (capture, passes and their
measurements, verification, the final timing check); compile time is ``torch.compile``'s first
call.

Targets (issue 26): distopt ≥ ``target_vs_compile``× torch.compile's speed, with optimize time
≤ ``target_setup_ratio``× torch.compile's first call, for every model and thread count.

Calls are timed as distopt's own measurements time them (:func:`distopt.estimate.ab.default_clock`):
wall time, or with one thread on the CPU the calling thread's CPU time, which a shared host does
not inflate. Setup times are wall time; the load average is recorded with each row. With
``device: cuda`` the models run on the GPU (thread counts then set only the host's side).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch
import torch._dynamo
from rich.table import Table
from torch import nn

import distopt
from distopt.bench import median
from distopt.bench._inductor import probe_inductor_cpu
from distopt.config import check, from_dict, to_dict
from distopt.console import console as make_console
from distopt.estimate.ab import default_clock, wall_clock
from distopt.optimize.verify import exact_math
from distopt.report import report_of
from distopt.training.config import Device
from distopt.training.device import device_name, resolve_device

MODELS = ("resnet50", "convnext_tiny")


@dataclasses.dataclass(kw_only=True, slots=True)
class ThirdPartyFusionConfig:
    models: tuple[str, ...] = MODELS
    """``resnet50`` (transformers' ResNetConfig defaults) and/or ``convnext_tiny`` (ConvNextConfig
    defaults)."""
    image_size: int = 224
    batch_size: int = 8
    threads: tuple[int, ...] = (0, 1)
    """Intra-op thread counts to run at; 0 is torch's default (all cores)."""
    rounds: int = 7
    """Interleaved timing rounds (one call of each variant per round) after one warm-up call."""
    compile: bool = True
    """Include ``torch.compile`` (needs a C++ compiler; minutes on 2 cores)."""
    target_vs_compile: float = 1.0
    target_setup_ratio: float = 0.3
    """distopt's optimize time as a fraction of torch.compile's first call, at most."""
    device: Device = "cpu"

    def __post_init__(self) -> None:
        for name in self.models:
            check(name in MODELS, "models", f"names among {', '.join(MODELS)}", name)
        check(self.image_size >= 32, "image_size", "an integer >= 32", self.image_size)
        check(self.batch_size >= 1, "batch_size", "an integer >= 1", self.batch_size)
        check(all(t >= 0 for t in self.threads), "threads", "integers >= 0", self.threads)
        check(self.rounds >= 1, "rounds", "an integer >= 1", self.rounds)


def build(name: str, image_size: int = 224) -> nn.Module:
    """A transformers model from its config, random weights, eval mode, on the CPU."""
    import transformers  # optional (distopt[coverage])

    torch.manual_seed(0)
    if name == "resnet50":
        return transformers.ResNetForImageClassification(transformers.ResNetConfig()).eval()
    return transformers.ConvNextForImageClassification(
        transformers.ConvNextConfig(image_size=image_size)
    ).eval()


def _logits(module: Callable[..., Any], x: torch.Tensor) -> Callable[[], torch.Tensor]:
    def call() -> torch.Tensor:
        with torch.no_grad():
            return module(x).logits

    return call


def _compile_cold(model: nn.Module, x: torch.Tensor) -> tuple[Callable[..., Any], float]:
    """``torch.compile`` with a fresh Inductor cache directory; returns its first call's seconds."""
    previous = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="distopt-bench-inductor-")
    try:
        compiled = torch.compile(model)
        return compiled, wall_clock("torch.compile", _logits(compiled, x))
    finally:
        if previous is None:
            os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)
        else:
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = previous


def _kept_passes(module: nn.Module) -> list[str]:
    report = report_of(module)
    if report is None:
        return []
    lines = [
        f"{rec.name}: {rec.detail}"
        for graph in report.graphs
        for rec in graph.passes
        if rec.name in ("fold_conv_bn", "mkldnn_fusion", "channels_last")
    ]
    return lines + ([f"speed: {report.speed}"] if report.speed else [])


def _one(
    cfg: ThirdPartyFusionConfig, name: str, threads: int, device: torch.device, console: Any
) -> dict[str, Any]:
    # Nothing compiled for an earlier row may serve this one (Dynamo reuses code across model
    # instances); within the row, distopt's capture and torch.compile keep separate entries.
    torch._dynamo.reset()
    torch.set_num_threads(threads)
    model = build(name, cfg.image_size).to(device)
    x = torch.randn(
        cfg.batch_size,
        3,
        cfg.image_size,
        cfg.image_size,
        generator=torch.Generator().manual_seed(1),
    ).to(device)
    console.print(f"{name}, {torch.get_num_threads()} threads: distopt.optimize…")
    start = time.perf_counter()
    ours = distopt.optimize(model, x)
    setup = {"distopt optimize": time.perf_counter() - start}
    variants: dict[str, Callable[[], torch.Tensor]] = {
        "eager": _logits(model, x),
        "distopt": _logits(ours, x),
    }
    if cfg.compile:
        console.print(f"{name}: torch.compile, cold caches…")
        compiled, setup["torch.compile first call"] = _compile_cold(model, x)
        variants["torch.compile"] = _logits(compiled, x)
    with exact_math():  # full float32: CUDA's default TF32 convolutions alone differ by ~1e-2
        ref = variants["eager"]()
        for label, fn in variants.items():
            diff = (fn() - ref).abs().max().item()
            if diff > 1e-3 * max(1.0, ref.abs().max().item()):
                raise AssertionError(f"{name}: {label} differs from eager by {diff:.3g}")
    samples: dict[str, list[float]] = {label: [] for label in variants}
    for _ in range(cfg.rounds):
        for label, fn in variants.items():
            samples[label].append(default_clock(label, fn))
    times = {label: median(values) for label, values in samples.items()}
    row: dict[str, Any] = {
        "model": name,
        "threads": torch.get_num_threads(),
        "device_name": device_name(device),
        "median_s": times,
        "setup_s": setup,
        "distopt_vs_eager": times["eager"] / times["distopt"],
        "passes": _kept_passes(ours),
        "load_average": os.getloadavg()[0],
    }
    if cfg.compile:
        row["distopt_vs_compile"] = times["torch.compile"] / times["distopt"]
        row["compile_vs_eager"] = times["eager"] / times["torch.compile"]
        row["setup_ratio"] = setup["distopt optimize"] / setup["torch.compile first call"]
        row["target_met"] = (
            row["distopt_vs_compile"] >= cfg.target_vs_compile
            and row["setup_ratio"] <= cfg.target_setup_ratio
        )
    return row


def run(config: dict, args: argparse.Namespace) -> int:
    cfg = from_dict(ThirdPartyFusionConfig, config)
    device = resolve_device(cfg.device)
    console = make_console()
    # Dynamo's one-time start-up (imports, first frame) is paid before anything is timed: both
    # distopt (its capture tier) and torch.compile use it.
    torch.compile(lambda t: t + 1, backend="eager")(torch.ones(1))
    # So is Inductor's probe of the machine's vector ISAs, which the first row's compile paid alone.
    probe_s = probe_inductor_cpu() if cfg.compile and device.type == "cpu" else 0.0
    default_threads = torch.get_num_threads()
    rows = [
        _one(cfg, name, threads or default_threads, device, console)
        for name in cfg.models
        for threads in cfg.threads
    ]
    torch.set_num_threads(default_threads)
    table = Table(
        title=f"eval on {rows[0]['device_name']}, batch {cfg.batch_size}×3×{cfg.image_size}², "
        f"median of {cfg.rounds} interleaved rounds"
    )
    for column in (
        "model",
        "threads",
        "eager ms",
        "distopt ms",
        "compile ms",
        "distopt/eager",
        "distopt/compile",
        "optimize s",
        "compile s",
        "setup ratio",
        "target",
    ):
        table.add_column(column, justify="left" if column == "model" else "right")
    for row in rows:
        t, s = row["median_s"], row["setup_s"]
        table.add_row(
            row["model"],
            str(row["threads"]),
            f"{t['eager'] * 1e3:.1f}",
            f"{t['distopt'] * 1e3:.1f}",
            f"{t['torch.compile'] * 1e3:.1f}" if "torch.compile" in t else "–",
            f"{row['distopt_vs_eager']:.2f}×",
            f"{row.get('distopt_vs_compile', 0):.2f}×",
            f"{s['distopt optimize']:.1f}",
            f"{s.get('torch.compile first call', 0):.1f}",
            f"{row.get('setup_ratio', 0):.2f}",
            {True: "ok", False: "MISSED", None: "–"}[row.get("target_met")],
        )
    console.print(table)
    for row in rows:
        console.print(f"{row['model']} @ {row['threads']} threads: " + " | ".join(row["passes"]))
    ok = all(row.get("target_met", True) for row in rows)
    console.print(
        f"targets: distopt ≥ {cfg.target_vs_compile}× torch.compile, optimize ≤ {cfg.target_setup_ratio}× "
        f"its first call: {'ok' if ok else 'MISSED'}"
    )
    if getattr(args, "json", None):
        with open(args.json, "w") as fh:
            json.dump(
                {"config": to_dict(cfg), "rows": rows, "target_met": ok, "isa_probe_s": probe_s},
                fh,
                indent=2,
            )
    return 0 if ok else 1
