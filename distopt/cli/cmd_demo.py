"""``distopt demo`` (what ``make demo`` runs): a parameter-server job, baseline vs optimized.

Writes a Criteo-format click log with a signal to learn (``distopt.data.generate``) under
``--out``, then launches ``configs/jobs/demo.yaml`` (a DLRM, 1 parameter server answering after
5 ms, 2 DDP trainers) through TorchX on ``local_cwd``, as written (``variant=baseline``) and
rewritten by ``distopt.optimize`` (``variant=optimized``), in ``--rounds`` alternated rounds
(baseline, optimized; then optimized, baseline; ...): the host's speed drifts on a shared
machine, and alternating shorter jobs keeps the drift from favouring either variant. It prints
the held-out AUC and loss each reached (deterministic jobs: the same for both), then the
``distopt compare`` table of the pooled jobs (its gain and interval over the rounds: the jobs of
one run differ by more than their steps say, and a round is the unit that repeats; the interval
weighs the rounds of the latest earlier runs of the same job in ``--out``, :func:`earlier_rounds`)
with the cost model's per-phase prediction beside the measured phases, and writes the plot (with
matplotlib: ``pip install 'distopt[plot]'``). A pilot baseline job runs first: a job whose timed
steps would last under ``--min-timed-s`` is measured on longer jobs, sized from it
(:func:`sized_steps`).
Runs from any directory: the config is read relative to it, else from the copy shipped with
distopt; logs go under ``--out`` there.
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import sys
import time
from pathlib import Path

from distopt.bench import steps_lasting
from distopt.cli import main as distopt_main
from distopt.config import find_config_file, load_config
from distopt.data.generate import write_criteo
from distopt.dist.rendezvous import free_port
from distopt.errors import ConfigError, DistoptError
from distopt.metrics import load_run
from distopt.metrics.compare import DEFAULT_WARMUP, compare_runs, config_diff, summarize
from distopt.metrics.records import RunLog
from distopt.torchx.submit import launch
from distopt.training.config import JobConfig


def add_parser(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("demo", help="run the PS workload baseline vs optimized and compare")
    parser.add_argument("--config", default="configs/jobs/demo.yaml", help="job config")
    parser.add_argument("--steps", type=int, default=100, help="training steps per job")
    parser.add_argument(
        "--rounds",
        type=int,
        default=4,
        help="alternated rounds of one baseline and one optimized job (default 4, ABBA order: "
        "the gain's interval is over rounds, and two rounds give it one degree of freedom)",
    )
    parser.add_argument(
        "--min-timed-s",
        type=float,
        default=MIN_TIMED_S,
        help=f"seconds each job's timed steps (after the warm-up) last at least (default "
        f"{MIN_TIMED_S:g}): a pilot baseline job, not one of the rounds, runs first, and when its "
        f"timed steps were shorter every job of the rounds runs as many more steps as that takes "
        f"(at most {MAX_STEPS_FACTOR}x --steps); 0: no pilot",
    )
    parser.add_argument("--out", default="runs/demo", help="where logs and the plot go")
    parser.add_argument(
        "--assert-prediction",
        type=float,
        metavar="TOL",
        help="exit 1 unless the predicted gain is within TOL (0.15: ±15%%) of the measured one "
        "(as distopt compare --assert-prediction)",
    )
    parser.set_defaults(func=run)


def _launch(config: Path, overrides: list[str], variant: str, run_id: str) -> None:
    """One job of the demo, submitted as ``distopt launch`` submits it (quiet while it runs; a
    failure named as ``distopt launch`` names it)."""
    start = time.perf_counter()
    with launch(
        config,
        "local_cwd",
        overrides=[f"variant={variant}", *overrides],
        run_id=run_id,
        component_args={"master_port": free_port(consecutive=2)},
    ) as job:
        print(f"{variant} job {job.handle}: logs in {job.run_dir}", flush=True)
        report = job.failure_report(job.wait())
        if report is not None:
            print(report, file=sys.stderr, flush=True)
            raise DistoptError(f"demo: the {variant} job {job.handle} failed")
    print(f"{variant} job finished in {time.perf_counter() - start:.0f} s", flush=True)


MIN_TIMED_S = 4.0
"""Seconds of timed steps per job, at least. A job's step time moves between regimes that last
seconds on a shared host (examples/own_model, 2 trainers and a server on 2 cores: medians of 20
steps between 4 and 7.5 ms, holding for a second or more), so a job timed for under a second
measures one regime: its 120-step rounds' gains were 1.59, 1.12, 1.02 and 1.37 for two variants
computing the same model. Its 600-step jobs (about 4 s timed) measured 1.03 [0.94, 1.11]."""

MAX_STEPS_FACTOR = 20
"""A pilot lengthens the jobs by this factor at most (a step of microseconds must not make the
demo run for hours)."""


def sized_steps(steps: int, warmup: int, median_step_s: float, min_timed_s: float) -> int:
    """Steps per job for the timed ones (after ``warmup``) to last ``min_timed_s`` at
    ``median_step_s`` a step: ``steps`` when they already do, at most ``MAX_STEPS_FACTOR`` times
    it."""
    return steps_lasting(steps, warmup, median_step_s, min_timed_s, MAX_STEPS_FACTOR * steps)


CLICKS = 12_000
"""Lines of the demo's click log (a quarter held out)."""


def _learned(run_dir: Path) -> str:
    """What a run learned: its last held-out evaluation (AUC, loss) and its final training loss."""
    rank = load_run(run_dir).ranks[0]
    final = (
        f"final training loss {rank.steps[-1].loss:.4f}"
        if rank.steps and rank.steps[-1].loss is not None
        else ""
    )
    if not rank.evals:
        return final or "no loss recorded"
    last = rank.evals[-1]
    held = ", ".join(
        f"{name.removeprefix('eval_')} {value:.4f}"
        for name, value in sorted(last.metrics.items())
        if name != "eval_samples"
    )
    return f"held-out {held} after {last.step} steps" + (f"; {final}" if final else "")


def _warmup(steps: int) -> int:
    """Steps of each job not timed: short runs (``--steps 3`` in tests) still leave some."""
    return min(DEFAULT_WARMUP, steps // 2)


def _sized_by_pilot(pilot: Path, steps: int, min_timed_s: float) -> int:
    """The rounds' steps per job (:func:`sized_steps`) from the pilot job's median step, said."""
    warmup = _warmup(steps)
    step_s = summarize(load_run(pilot), label=pilot.name, warmup=warmup).median_step_time_s
    sized = sized_steps(steps, warmup, step_s, min_timed_s)
    print(
        f"pilot: {steps - warmup} timed steps of {step_s * 1e3:.2f} ms (median) take "
        f"{(steps - warmup) * step_s:.1f} s (--min-timed-s {min_timed_s:g}): every job of the "
        f"rounds runs {sized} steps",
        flush=True,
    )
    return sized


_VARIANTS = ("baseline", "optimized")

EARLIER_RUNS = 8
"""Earlier runs (the latest) whose rounds' spread the gain's interval pools."""


def earlier_rounds(out: Path, stamp: str, baseline: Path) -> list[tuple[str, tuple[float, ...]]]:
    """``(stamp, round gains)`` of the latest :data:`EARLIER_RUNS` demo runs in ``out`` before
    ``stamp`` that ran this job (:func:`_differs`; the steps a pilot chose aside), with two or
    more rounds, every job finished: the gain's interval weighs their rounds with this run's
    (:func:`distopt.metrics.compare.rounds_interval`)."""
    current = load_run(baseline)
    found = []
    for first in sorted(out.glob("demo-*-baseline-0"), reverse=True):
        earlier = first.name.removeprefix("demo-").removesuffix("-baseline-0")
        if earlier >= stamp:  # stamps sort as times do
            continue
        try:
            rounds = _rounds_of(out, earlier, current)
        except Exception:  # an earlier run's leftovers, unreadable: not this run's input
            continue
        if rounds is not None:
            found.append((earlier, rounds))
        if len(found) == EARLIER_RUNS:
            break
    return found


def _rounds_of(out: Path, stamp: str, current: RunLog) -> tuple[float, ...] | None:
    """The round gains of the demo run ``stamp`` in ``out``, if it ran ``current``'s job to the
    end in two or more rounds."""
    first = load_run(out / f"demo-{stamp}-baseline-0")
    if _differs(current, first):
        return None
    jobs = [[load_run(job) for job in _round_jobs(out, stamp, variant)] for variant in _VARIANTS]
    if len(jobs[0]) != len(jobs[1]) or len(jobs[0]) < 2:
        return None
    if not all(_finished(job) for variant in jobs for job in variant):
        return None
    gain = compare_runs(jobs, warmup=_warmup(int(first.config["steps"]))).gains[0]
    return gain.rounds if all(math.isfinite(g) and g > 0 for g in gain.rounds) else None


def _finished(job: RunLog) -> bool:
    """Whether every rank of ``job`` wrote a footer that says it finished (a run killed before
    its footer may be cut short)."""
    return all(log.footer and log.footer.get("status") == "ok" for log in job.ranks.values())


def _round_jobs(out: Path, stamp: str, variant: str) -> list[Path]:
    """A demo run's jobs of ``variant``, in round order (``-10`` after ``-9``)."""
    jobs = out.glob(f"demo-{stamp}-{variant}-*")
    return sorted(jobs, key=lambda job: int(job.name.rsplit("-", 1)[1]))


def _differs(run: RunLog, other: RunLog) -> bool:
    """Whether ``other`` ran another job than ``run``: another config, other code (distopt's
    commit, not uncommitted edits; the versions) or another host."""
    mine, theirs = run.header, other.header
    if any(mine.get(key) != theirs.get(key) for key in ("git_revision", "versions")):
        return True
    if (mine.get("host") or {}).get("hostname") != (theirs.get("host") or {}).get("hostname"):
        return True
    return bool(set(config_diff([run, other], ["this", "earlier"])) - {"steps"})


def alternated(rounds: int) -> list[str]:
    """The variants' job order: each round one of each, every other round the other first
    (ABBA...), so that a host getting steadily faster or slower favours neither."""
    pair = list(_VARIANTS)
    return [v for i in range(rounds) for v in (pair if i % 2 == 0 else pair[::-1])]


def run(args: argparse.Namespace) -> int:
    if args.steps < 1:
        raise ConfigError(f"--steps: expected an integer >= 1, got {args.steps}")
    if args.rounds < 1:
        raise ConfigError(f"--rounds: expected an integer >= 1, got {args.rounds}")
    if not args.min_timed_s >= 0:
        raise ConfigError(f"--min-timed-s: expected seconds >= 0, got {args.min_timed_s}")
    if args.assert_prediction is not None and not args.assert_prediction >= 0:
        raise ConfigError(
            f"--assert-prediction: expected a fraction >= 0, got {args.assert_prediction}"
        )
    config = find_config_file(args.config)
    if not config.is_file():
        raise ConfigError(f"--config: config file not found: {args.config}")
    out = Path(args.out).resolve()
    overrides = [f"output_dir={out}"]
    if load_config(JobConfig, config).data.source == "criteo":
        clicks = out / "clicks.tsv"
        if not clicks.is_file():
            print(f"writing a click log to learn from: {clicks}", flush=True)
            write_criteo(clicks, num_samples=CLICKS, seed=0)
        overrides.append(f"data.path={clicks}")
    stamp = time.strftime("%Y%m%d-%H%M%S")
    steps = args.steps
    if args.min_timed_s > 0:
        pilot = f"demo-{stamp}-pilot"
        _launch(config.resolve(), [*overrides, f"steps={steps}"], "baseline", pilot)
        steps = _sized_by_pilot(out / pilot, steps, args.min_timed_s)
    runs: dict[str, list[str]] = {"baseline": [], "optimized": []}
    for variant in alternated(args.rounds):
        run_id = f"demo-{stamp}-{variant}" + (f"-{len(runs[variant])}" if args.rounds > 1 else "")
        _launch(config.resolve(), [*overrides, f"steps={steps}"], variant, run_id)
        runs[variant].append(str(out / run_id))
        print(f"{variant}: {_learned(out / run_id)}", flush=True)
    compare = [",".join(jobs) for jobs in runs.values()]
    compare += ["--warmup", str(_warmup(steps))]
    if args.rounds > 1:
        earlier = earlier_rounds(out, stamp, Path(runs["baseline"][0]))
        if earlier:
            print(
                f"pooling the rounds' spread with {len(earlier)} earlier run"
                f"{'s' * (len(earlier) > 1)} of this job in {out}: "
                + ", ".join(earlier_stamp for earlier_stamp, _ in earlier),
                flush=True,
            )
        for _, gains in earlier:
            compare += ["--earlier-rounds", ",".join(f"{g:.6g}" for g in gains)]
    if args.assert_prediction is not None:
        compare += ["--assert-prediction", str(args.assert_prediction)]
    if importlib.util.find_spec("matplotlib") is not None:
        compare += ["--plot", str(out / f"demo-{stamp}.png")]
    else:
        print("no plot: matplotlib is not installed (pip install 'distopt[plot]')", flush=True)
    return distopt_main(["compare", *compare])
