"""``distopt explain MODEL``: optimize a model and print what distopt did to it.

MODEL is a registered model name (``distopt explain gpt``) or ``package.module:factory`` where the
factory returns a module, or ``(module, example_inputs)``.
"""

from __future__ import annotations

import argparse
import statistics
import warnings
from typing import Any

import torch
from torch import nn

import distopt
import distopt.ps as ps
from distopt import models
from distopt.errors import ConfigError, DistoptFallbackWarning
from distopt.estimate.ab import now
from distopt.optimize.gain import predict_gain
from distopt.pipeline import pipeline_split


def add_parser(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("explain", help="optimize a model and print the explain report")
    parser.add_argument("model", help="registered model name or package.module:factory")
    parser.add_argument("--passes", help="comma-separated pass names (default: the default passes)")
    parser.add_argument("--batch-size", type=int, default=4, help="batch of the example inputs")
    parser.add_argument("--no-verify", action="store_true", help="skip output/gradient checks")
    parser.add_argument("--no-code", action="store_true", help="omit the generated-code diff")
    parser.add_argument("--graph", metavar="PATH", help="write a graph picture (.svg/.png/.dot)")
    parser.add_argument("--eval", action="store_true", help="optimize the model in eval mode")
    parser.add_argument("--strict", action="store_true", help="raise instead of falling back")
    parser.add_argument(
        "--pipeline",
        action="store_true",
        help="also split the prefetch stage of a pipeline (distopt.pipeline) and show it",
    )
    parser.add_argument(
        "--ps-latency-ms",
        type=float,
        default=None,
        metavar="MS",
        help="for parameter-server models: start local PS processes with this "
        "injected latency and show the cost model's prediction next to "
        "measured forward times",
    )
    parser.set_defaults(func=run)


def load_model(spec: str, batch_size: int) -> tuple[nn.Module, tuple[Any, ...] | None]:
    """The model ``spec`` names, as a job builds it (:mod:`distopt.models`), and its example
    inputs when it has any (none: the report has no verification)."""
    model = models.build(spec)
    try:
        return model, models.make_inputs(spec, model, batch_size)
    except ConfigError:
        if ":" not in spec:
            raise  # a registered model always has inputs: this is a real error
        return model, None


def run(args: argparse.Namespace) -> int:
    torch.manual_seed(0)
    model, inputs = load_model(args.model, args.batch_size)
    if args.eval:
        model.eval()
    tables = getattr(model, "ps_tables", None)
    if args.ps_latency_ms is None:
        _explain(args, model, inputs)
        return 0
    if tables is None:
        raise ConfigError(
            f"--ps-latency-ms: {args.model!r} is not a parameter-server model "
            f"({type(model).__name__} has no ps_tables() method)"
        )
    if inputs is None:
        raise ConfigError(
            f"--ps-latency-ms: {args.model!r} gives no example inputs to time the forward on: "
            "make the factory return (model, example_inputs), or give "
            f"{type(model).__name__} an example_inputs(batch_size, seed) method"
        )
    with ps.local_job(tables(), ps.ServerOptions(latency_ms=args.ps_latency_ms)):
        optimized = _explain(args, model, inputs)
        _predict_and_measure(model, optimized, inputs)
    return 0


def _explain(
    args: argparse.Namespace, model: nn.Module, inputs: tuple[Any, ...] | None
) -> nn.Module:
    passes = [p.strip() for p in args.passes.split(",") if p.strip()] if args.passes else None
    with warnings.catch_warnings():
        # The report printed below says why; the warning would name this file, not the user's.
        warnings.simplefilter("ignore", DistoptFallbackWarning)
        optimized = distopt.optimize(
            model,
            inputs,
            passes=passes,
            verify=None if not args.no_verify else False,
            strict=args.strict,
        )
    if args.pipeline:
        distopt.explain(
            pipeline_split(optimized).main, show_code=not args.no_code, graph_path=args.graph
        )
        return optimized
    distopt.explain(optimized, show_code=not args.no_code, graph_path=args.graph)
    return optimized


def _predict_and_measure(
    model: nn.Module, optimized: nn.Module, inputs: tuple[Any, ...], rounds: int = 5, steps: int = 5
) -> None:
    """Cost-model prediction of the forward time before/after, next to measured medians."""
    prediction = predict_gain(model, optimized, inputs).forward
    times: dict[str, list[float]] = {"before": [], "after": []}
    with torch.no_grad(), ps.context.isolated_step():
        for _ in range(rounds):  # interleaved, so drift hits both alike
            for name, module in (("before", model), ("after", optimized)):
                for _ in range(steps):
                    start = now()
                    module(*inputs)
                    times[name].append(now() - start)
    before, after = (statistics.median(times[k]) for k in ("before", "after"))
    print(f"cost model: {prediction.summary()}")
    print(
        f"measured forward (median of {rounds * steps}, interleaved): {before * 1e3:.2f} ms -> "
        f"{after * 1e3:.2f} ms ({before / after:.2f}x); predicted {prediction.before_s * 1e3:.2f} ms -> "
        f"{prediction.after_s * 1e3:.2f} ms ({prediction.speedup:.2f}x)"
    )
