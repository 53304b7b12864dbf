"""``distopt data stats FILE``: how skewed the ids of a Criteo-format click log are.

Prints, per categorical feature (and per table with ``--num-tables``/``--num-rows``), the
distinct ids, the fitted Zipf exponent α and the share of accesses its most frequent ids take
(:mod:`distopt.data.stats`).
"""

from __future__ import annotations

import argparse

from rich.table import Table

from distopt.console import console as make_console
from distopt.data.criteo import TableLayout
from distopt.data.stats import IdStats, criteo_id_stats
from distopt.errors import ConfigError


def add_parser(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("data", help="inspect training data")
    actions = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    stats = actions.add_parser(
        "stats",
        help="distinct ids and fitted Zipf α per feature of a Criteo-format file",
        description="Per categorical feature of a Criteo-format file (and per table with "
        "--num-tables and --num-rows): the distinct ids, the Zipf exponent α fitted by maximum "
        "likelihood, and the share of accesses its most frequent ids take.",
    )
    stats.add_argument("file", help="Criteo-format click log (tab-separated, 40 fields)")
    stats.add_argument(
        "--max-lines", type=int, default=None, help="read only the first N lines (default: all)"
    )
    stats.add_argument(
        "--min-count",
        type=int,
        default=10,
        help="fit α over the ids seen at least this often (default 10; rarer ids rank by noise)",
    )
    stats.add_argument(
        "--cache-fraction",
        type=float,
        default=0.02,
        help="report the share of accesses of this fraction of the most frequent ids (default 0.02)",
    )
    stats.add_argument("--num-tables", type=int, default=None, help="also per table: K tables")
    stats.add_argument("--num-rows", type=int, default=None, help="rows per table (with K)")
    stats.add_argument("--bag-size", type=int, default=None, help="ids per table and sample")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if (args.num_tables is None) != (args.num_rows is None):
        raise ConfigError(
            "--num-tables and --num-rows: give both (per-table statistics) or neither"
        )
    layout = None
    if args.num_tables is not None:
        layout = TableLayout(
            num_tables=args.num_tables,
            num_rows=args.num_rows,
            bag_size=args.bag_size,
            key="--num-tables",
        )
    features, tables = criteo_id_stats(
        args.file,
        layout=layout,
        max_lines=args.max_lines,
        min_count=args.min_count,
        cache_fraction=args.cache_fraction,
    )
    console = make_console()
    top = f"top {args.cache_fraction:.0%} share"
    console.print(_table(f"{args.file}: ids per feature", features, top, missing=True))
    if tables:
        console.print(_table(f"{args.file}: row ids per table", tables, top, missing=False))
    return 0


def _table(title: str, rows: list[IdStats], top: str, *, missing: bool) -> Table:
    table = Table(title=title)
    columns = ["", "accesses", *(["missing"] if missing else []), "distinct", "α (MLE)", top]
    for column in columns:
        table.add_column(column, justify="right")
    for s in rows:
        alpha = "-" if s.alpha is None else f"{s.alpha:.3f}"
        cells = [s.name, str(s.accesses), *([f"{s.missing:.1%}"] if missing else [])]
        table.add_row(*cells, str(s.distinct), alpha, f"{s.top_share:.1%}")
    return table
