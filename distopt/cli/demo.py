"""``distopt demo``: what ``make demo`` runs.

Until the TorchX parameter-server demo lands (issue 5) it optimizes the reference models and
prints their explain reports.
"""

from __future__ import annotations

import argparse

import torch

import distopt
from distopt import models


def add_parser(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("demo", help="run the distopt demo")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    for name in ("mlp", "cnn", "gpt", "control_flow"):
        torch.manual_seed(0)
        model = models.build(name)
        optimized = distopt.optimize(model, models.make_inputs(name, model, 4))
        distopt.explain(optimized, show_code=name == "gpt")
        print()
    return 0
