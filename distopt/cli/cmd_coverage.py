"""``distopt coverage``: optimize third-party models and report tier, passes and correctness."""

from __future__ import annotations

import argparse
import dataclasses
import json

from rich.table import Table

from distopt.console import console as make_console
from distopt.coverage import corpus, run_corpus
from distopt.errors import ConfigError


def add_parser(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("coverage", help="capture coverage over third-party models")
    parser.add_argument(
        "--only",
        action="append",
        default=[],
        metavar="NAME",
        help="run only this corpus entry (repeatable)",
    )
    parser.add_argument("--json", metavar="PATH", help="also write the rows as JSON")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    console = make_console()
    entries = corpus()
    known = {e.name for e in entries}
    for name in args.only:
        if name not in known:
            raise ConfigError(
                f"--only: unknown corpus entry {name!r} (known: {', '.join(sorted(known))})"
            )
    entries = [e for e in entries if not args.only or e.name in args.only]
    missing = sorted({e.library for e in entries if not e.available})
    if missing:
        raise ConfigError(f"coverage needs {', '.join(missing)} (pip install {' '.join(missing)})")
    rows = run_corpus(
        entries, progress=lambda e: console.print(f"optimizing {e.library}:{e.name}…")
    )
    table = Table(title="distopt capture coverage (third-party models, random weights)")
    for column in ("model", "domain", "library", "tier", "graphs", "passes changed", "result", "s"):
        table.add_column(column, no_wrap=True)
    table.add_column("reason", overflow="fold")
    for row in rows:
        style = {"verified": "green", "fallback": "yellow"}.get(row.outcome, "bold red")
        table.add_row(
            row.name,
            row.domain,
            row.library,
            row.tier,
            str(row.graphs),
            str(row.passes_changed),
            f"[{style}]{row.outcome}[/{style}]",
            f"{row.seconds:.1f}",
            row.reason[:70],
        )
    console.print(table)
    tiers = {
        t: sum(r.tier == t for r in rows) for t in ("symbolic_trace", "dynamo", "eager_fallback")
    }
    wrong = [r.name for r in rows if r.outcome == "SILENTLY WRONG"]
    console.print(
        f"{len(rows)} models: "
        + ", ".join(f"{n} {t}" for t, n in tiers.items())
        + f"; correct model returned for {len(rows) - len(wrong)}/{len(rows)}"
    )
    if args.json:
        with open(args.json, "w") as fh:
            json.dump([dataclasses.asdict(r) for r in rows], fh, indent=2)
    if wrong:
        console.print(f"[bold red]silently wrong: {', '.join(wrong)}[/bold red]")
        return 1
    return 0
