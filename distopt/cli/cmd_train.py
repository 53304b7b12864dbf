"""``distopt train --config JOB.yaml [--set k=v ...]``: ``python -m distopt.train`` in this process.

The role comes from the environment as for ``python -m distopt.train`` (a lone trainer when none
is set); the exit status is the same (2: bad config or environment, 1: training failed).
"""

from __future__ import annotations

import argparse

from distopt import train


def add_parser(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "train",
        help="run a training job process here (python -m distopt.train)",
        description=train.__doc__.splitlines()[0] if train.__doc__ else None,
    )
    parser.add_argument("--config", required=True, help="job config YAML (see configs/jobs/)")
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config key (dotted for nested keys; value parsed as YAML)",
    )
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    argv = ["--config", args.config, *[a for item in args.overrides for a in ("--set", item)]]
    return train.main(argv, prog="distopt train")
