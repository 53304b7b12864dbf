"""``distopt train --config JOB.yaml [--set k=v ...]``: ``python -m distopt.train`` in this process.

The role comes from the environment as for ``python -m distopt.train`` (a lone trainer when none
is set); the exit status is the same (2: bad config or environment, 1: training failed).
"""

from __future__ import annotations

import argparse

from distopt import train
from distopt.training.config import add_job_arguments


def add_parser(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "train",
        help="run a training job process here (python -m distopt.train)",
        description=train.__doc__.splitlines()[0] if train.__doc__ else None,
    )
    add_job_arguments(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    argv = ["--config", args.config, *[a for item in args.overrides for a in ("--set", item)]]
    return train.main(argv, prog="distopt train")
