"""``distopt explain MODEL``: optimize a model and print what distopt did to it.

MODEL is a registered model name (``distopt explain gpt``) or ``package.module:factory`` where the
factory returns a module, or ``(module, example_inputs)``.
"""

from __future__ import annotations

import argparse
import importlib
from typing import Any

import torch
from torch import nn

import distopt
from distopt import models
from distopt.errors import ConfigError


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
    parser.set_defaults(func=run)


def load_model(spec: str, batch_size: int) -> tuple[nn.Module, tuple[Any, ...] | None]:
    if ":" not in spec:
        model = models.build(spec)
        return model, models.make_inputs(spec, model, batch_size)
    module_name, _, attr = spec.partition(":")
    try:
        factory = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as err:
        raise ConfigError(f"model {spec!r}: cannot import it ({err})") from None
    made = factory()
    if isinstance(made, tuple) and len(made) == 2 and isinstance(made[0], nn.Module):
        model, inputs = made
        return model, (inputs,) if isinstance(inputs, torch.Tensor) else tuple(inputs)
    if not isinstance(made, nn.Module):
        raise ConfigError(f"model {spec!r}: factory returned {type(made).__name__}, not a Module")
    return made, None


def run(args: argparse.Namespace) -> int:
    torch.manual_seed(0)
    model, inputs = load_model(args.model, args.batch_size)
    if args.eval:
        model.eval()
    passes = [p.strip() for p in args.passes.split(",") if p.strip()] if args.passes else None
    optimized = distopt.optimize(
        model, inputs, passes=passes, verify=None if not args.no_verify else False, strict=args.strict
    )
    distopt.explain(optimized, show_code=not args.no_code, graph_path=args.graph)
    return 0
