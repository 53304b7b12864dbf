"""``distopt compare RUN_A RUN_B [...]``: QPS of runs side by side, gain vs the first run.

Exit status: 0 on success, 1 when ``--assert-gain`` fails, 2 on bad input (missing run, malformed
log, configs that differ without ``--force``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from distopt.console import console as make_console
from distopt.metrics.compare import (
    DEFAULT_BLOCK,
    DEFAULT_LEVEL,
    DEFAULT_RESAMPLES,
    DEFAULT_SEED,
    DEFAULT_WARMUP,
    UNCHANGED,
    CompareError,
    Comparison,
    compare_runs,
    failed_gains,
    mispredicted,
    shown_label,
)
from distopt.metrics.plot import plot_comparison
from distopt.metrics.qps_log import load_run


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "compare",
        help="compare QPS logs of runs (first run is the baseline)",
        description=(
            "Compare the QPS logs of two or more runs. The first run is the baseline; each other "
            "run's gain is its median QPS over the baseline's, with a percentile-bootstrap "
            "confidence interval (ratio of medians over blocks of consecutive steps, seeded). "
            "Runs whose logs carry the cost model's per-phase prediction also get a table of "
            "predicted vs measured phases."
        ),
    )
    parser.add_argument(
        "runs",
        nargs="+",
        metavar="RUN",
        help=(
            "run directory or qps-rank*.jsonl file; several jobs of one variant joined by commas "
            "are pooled into one run (e.g. jobs alternated with the other variant's)"
        ),
    )
    parser.add_argument(
        "--warmup",
        type=int,
        default=DEFAULT_WARMUP,
        help=f"steps left out at the start of each run (default {DEFAULT_WARMUP})",
    )
    parser.add_argument("--plot", metavar="PNG", help="write QPS-over-steps and box plots here")
    parser.add_argument("--json", metavar="PATH", help="write machine-readable results here")
    parser.add_argument(
        "--assert-gain",
        type=float,
        metavar="X",
        help="exit 1 unless every run's gain (see --assert-stat) is >= X",
    )
    parser.add_argument(
        "--assert-stat",
        choices=("ci_low", "median"),
        default="ci_low",
        help="gain statistic --assert-gain checks: the CI lower bound (default) or the median",
    )
    parser.add_argument(
        "--assert-prediction",
        type=float,
        metavar="TOL",
        help="exit 1 unless every run's predicted gain is within TOL (a fraction: 0.15 is "
        "±15%%) of its measured median gain",
    )
    parser.add_argument(
        "--force", action="store_true", help="compare even if configs differ beyond the variant"
    )
    parser.add_argument(
        "--ci-level", type=float, default=DEFAULT_LEVEL, help=f"CI level (default {DEFAULT_LEVEL})"
    )
    parser.add_argument(
        "--resamples",
        type=int,
        default=DEFAULT_RESAMPLES,
        help=f"bootstrap resamples (default {DEFAULT_RESAMPLES})",
    )
    parser.add_argument(
        "--seed", type=int, default=DEFAULT_SEED, help=f"bootstrap seed (default {DEFAULT_SEED})"
    )
    parser.add_argument(
        "--block",
        type=int,
        default=DEFAULT_BLOCK,
        help=f"consecutive steps per resampled unit of the interval (default {DEFAULT_BLOCK})",
    )
    parser.add_argument(
        "--earlier-rounds",
        action="append",
        default=[],
        metavar="GAINS",
        help="round gains of an earlier run of the same comparison on this host, comma-separated "
        "as this command prints them (repeatable): the spread of each run's rounds about its own "
        "mean is pooled with this run's, so that rounds that agreed by chance do not make the "
        "interval narrow (distopt demo passes its earlier runs')",
    )
    parser.set_defaults(func=run)


def render(comparison: Comparison, console: Console) -> None:
    """Print the comparison table (and the config differences that ``--force`` let through)."""
    level = f"{comparison.level:.0%}"
    table = Table(
        title=f"QPS after {comparison.warmup} warm-up steps "
        f"(baseline: {shown_label(comparison.runs[0].label)})"
    )
    for name, justify in (
        ("run", "left"),
        ("variant", "left"),
        ("world size", "right"),
        ("steps", "right"),
        ("median QPS", "right"),
        ("p10", "right"),
        ("p90", "right"),
        (f"gain [{level} CI]", "right"),
        ("predicted", "right"),
    ):
        table.add_column(name, justify=justify)  # type: ignore[arg-type]
    gains = {g.label: g for g in comparison.gains}
    for run in comparison.runs:
        gain = gains.get(run.label)
        if gain is None:
            gain_text, predicted = "baseline", "-"
        else:
            gain_text = f"{gain.median:.3f}× [{gain.ci_low:.3f}, {gain.ci_high:.3f}]"
            predicted = "-" if gain.predicted is None else f"{gain.predicted:.3f}×"
        table.add_row(
            shown_label(run.label),
            run.variant,
            str(run.world_size),
            str(run.steps),
            f"{run.median_qps:,.1f}",
            f"{run.p10_qps:,.1f}",
            f"{run.p90_qps:,.1f}",
            gain_text,
            predicted,
        )
    console.print(table)
    console.print(f"interval: {comparison.interval}", markup=False)
    for gain in comparison.gains:
        if gain.over_rounds:
            rounds = gain.over_rounds
            console.print(
                f"{_short(gain.label)}: rounds' gains "
                + ", ".join(f"{g:.3f}×" for g in rounds.rounds)
                + f"; a repeat run of {len(rounds.rounds)} rounds would measure "
                f"[{rounds.repeat_low:.3f}, {rounds.repeat_high:.3f}] ({level} repeat interval"
                + (", rounds' noise alone" if rounds.noise_alone else "")
                + ")",
                markup=False,
            )
        if gain.prediction_error is not None:
            console.print(
                f"{_short(gain.label)}: predicted gain {gain.predicted:.3f}× vs measured "
                f"{gain.median:.3f}×: {gain.prediction_error:+.1%}",
                markup=False,
            )
        if gain.unchanged_differ and gain.unchanged_s is not None:
            base_s, run_s = gain.unchanged_s
            console.print(
                f"[yellow]note:[/yellow] {_short(gain.label)}: the phases the rewrite does not "
                f"change ({', '.join(UNCHANGED)}) took {base_s * 1e3:.2f} ms per step in the "
                f"baseline and {run_s * 1e3:.2f} ms here: the host, not the rewrite, moved that "
                "part of the measured gain (alternate the jobs, or run on a quieter host)"
            )
    if comparison.phases:
        render_phases(comparison, console)
    if any(run.fetches for run in comparison.runs):
        render_fetches(comparison, console)
    for line in comparison.unfinished:
        console.print(f"[yellow]--force: did not finish:[/yellow] {escape(line)}")
    if comparison.config_diff:
        console.print("[yellow]--force: configs differ in[/yellow]")
        for key, values in comparison.config_diff.items():
            shown = ", ".join(f"{label}={value!r}" for label, value in values.items())
            console.print(f"  {key}: {shown}", markup=False)


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.2f}"


def _short(label: str) -> str:
    """A run's label without its directories (each job's, in brace form, for pooled jobs)."""
    return shown_label(label, short=True)


def render_phases(comparison: Comparison, console: Console) -> None:
    """Per run with a per-phase prediction: each phase predicted vs measured (median, ms)."""
    base = _short(comparison.runs[0].label)
    for label in dict.fromkeys(row.label for row in comparison.phases):
        table = Table(title=f"step phases, median ms after warm-up: {base} vs {_short(label)}")
        for name in (
            "phase",
            "baseline predicted",
            "measured",
            "run predicted",
            "measured ",
            "error",
        ):
            table.add_column(name, justify="left" if name == "phase" else "right")
        for row in comparison.phases:
            if row.label == label:
                error = row.error
                table.add_row(
                    row.phase,
                    _ms(row.baseline_predicted),
                    _ms(row.baseline_measured),
                    _ms(row.predicted),
                    _ms(row.measured),
                    "-" if error is None else f"{error:+.0%}",
                )
        console.print(table)


def render_fetches(comparison: Comparison, console: Console) -> None:
    """Per run: what a trainer's step fetched from the parameter servers, and its row caches."""
    table = Table(title="parameter-server fetches per trainer step, after warm-up")
    columns = ("run", "rows (median)", "MiB (median)", "cache hit rate", "cache MiB", "staleness")
    for name in columns:
        table.add_column(name, justify="left" if name == "run" else "right")
    for run in comparison.runs:
        found = run.fetches or {}
        table.add_row(
            _short(run.label),
            _shown(found, "rows_fetched"),
            _shown(found, "bytes_fetched", 1 << 20, "{:,.2f}"),
            _shown(found, "cache_hit_rate", form="{:.1%}"),
            _shown(found, "cache_bytes", 1 << 20, "{:,.2f}"),
            _shown(found, "cache_staleness_max"),
        )
    console.print(table)


def _shown(found: dict[str, float], key: str, scale: float = 1.0, form: str = "{:,.0f}") -> str:
    value = found.get(key)
    return "-" if value is None else form.format(value / scale)


def _gains(text: str) -> list[float]:
    """``1.648,1.638×,...`` (as printed, the ``×`` optional) as numbers; a one-line error naming
    the value otherwise (their count and sign are checked where they are used)."""
    try:
        return [float(part.strip().removesuffix("×")) for part in text.split(",")]
    except ValueError:
        raise CompareError(
            f"--earlier-rounds {text!r}: expected round gains separated by commas, e.g. "
            "1.648,1.638,1.622,1.612"
        ) from None


def run(args: argparse.Namespace) -> int:
    if args.assert_prediction is not None and not args.assert_prediction >= 0:
        raise CompareError(
            f"--assert-prediction: expected a fraction >= 0, got {args.assert_prediction}"
        )
    earlier = [_gains(text) for text in args.earlier_rounds]
    logs = [[load_run(path) for path in arg.split(",")] for arg in args.runs]
    comparison = compare_runs(
        logs,
        labels=list(args.runs),
        warmup=args.warmup,
        force=args.force,
        resamples=args.resamples,
        level=args.ci_level,
        seed=args.seed,
        block=args.block,
        earlier_rounds=earlier,
    )
    if earlier and not any(gain.over_rounds for gain in comparison.gains):
        raise CompareError(
            "--earlier-rounds: no gain here is over rounds (give each run as many jobs, two or "
            "more, joined by commas)"
        )
    console = make_console()
    render(comparison, console)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(comparison.to_json(), indent=2) + "\n")
    if args.plot:
        print(f"plot: {plot_comparison(comparison, args.plot)}")
    if args.assert_prediction is not None:
        off = mispredicted(comparison, args.assert_prediction)
        if off:
            worst = off[0]
            said = (
                "has no prediction"
                if worst.prediction_error is None
                else f"is off by {worst.prediction_error:+.1%}"
            )
            print(
                f"distopt compare: assertion failed: the predicted gain of {worst.label} {said}, "
                f"beyond --assert-prediction {args.assert_prediction}"
                + (f" ({len(off)} runs)" if len(off) > 1 else ""),
                file=sys.stderr,
            )
            return 1
    if args.assert_gain is not None:
        failed = failed_gains(comparison, args.assert_gain, stat=args.assert_stat)
        if failed:
            worst = min(failed, key=lambda g: getattr(g, args.assert_stat))
            print(
                f"distopt compare: assertion failed: gain {args.assert_stat} of {worst.label} is "
                f"{getattr(worst, args.assert_stat):.3f}, below --assert-gain {args.assert_gain}"
                + (f" ({len(failed)} runs below)" if len(failed) > 1 else ""),
                file=sys.stderr,
            )
            return 1
    return 0
