"""``distopt bench CONFIG.yaml``: run a benchmark described by a YAML config (see distopt.bench)."""

from __future__ import annotations

import argparse

from distopt import bench
from distopt.config import apply_override, load_yaml
from distopt.errors import ConfigError


def add_parser(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("bench", help="run a benchmark config (configs/bench/*.yaml)")
    parser.add_argument("config", help="benchmark YAML with a `kind:` key")
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config value (repeatable)",
    )
    parser.add_argument("--json", metavar="PATH", help="also write results as JSON")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    data = load_yaml(args.config)
    for item in args.set:
        apply_override(data, item)
    kind = data.pop("kind", None)
    if kind is None:
        raise ConfigError(f"{args.config}: missing key 'kind' (known: {', '.join(bench.kinds())})")
    return int(bench.load(kind).run(data, args) or 0)
