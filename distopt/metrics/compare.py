"""Compare runs from their QPS logs: summary statistics, gain vs a baseline with a bootstrap CI,
the cost model's prediction, and a config check that the runs differ only in their variant.

Statistics use the merged (job-wide) QPS of each step after ``warmup`` steps; see
:meth:`distopt.metrics.qps_log.RunLog.merged_steps`.

Gain of run R vs baseline B = median QPS(R) / median QPS(B) (> 1 means R is faster). Its confidence
interval is a percentile block bootstrap: each run's post-warm-up steps are cut into blocks of
``block`` consecutive steps (the units: consecutive steps are not independent, a block of them
nearly is), each run's blocks are resampled with replacement independently, the ratio of medians
is recomputed ``resamples`` times, and the ``(1 - level) / 2`` and ``(1 + level) / 2`` quantiles
bound the interval (:attr:`Comparison.interval` says so in words).

Two jobs of one command differ by more than their steps say (the host, the processes'
placement), and drift *between* two jobs run one after the other is in no interval computed from
their steps: ``distopt demo`` alternates shorter jobs of each variant (docs/cost_model.md). When
both runs are pooled from the same number of jobs (``k`` ≥ 2, rounds: the i-th job of each run
paired, in the order given), the unit is the round: the gain is the geometric mean of the
rounds' gains (each a ratio of medians) and its interval a Student t interval over their logs,
``k - 1`` degrees of freedom, or more with earlier runs' rounds (``earlier_rounds``: their spread
is pooled, and from four runs on a between-run part of the variance counts;
:func:`rounds_interval`). A bootstrap over two or three jobs could not see more spread between
jobs than those few showed (two ``distopt demo`` runs whose intervals each missed the other's
gain); the t interval widens with few rounds as it should. Runs of unequal job counts are
resampled in two stages, jobs with replacement and then blocks within each drawn job.

When a run's header has the cost model's per-phase prediction (``predicted_phases``), the
comparison also puts each phase's prediction beside its measured median (:class:`PhaseRow`).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import scipy.stats

from distopt.errors import DistoptError
from distopt.estimate.step import StepPrediction, phase_medians
from distopt.metrics.records import MergedStep, RunLog, StepRecord

DEFAULT_WARMUP = 5
DEFAULT_RESAMPLES = 2000
DEFAULT_LEVEL = 0.95
DEFAULT_SEED = 0
PHASE_FLOOR_S = 1e-4
"""Phases shorter than this (predicted and measured) get no relative error."""
DEFAULT_BLOCK = 10
"""Consecutive steps per resampled unit of the gain's interval."""

#: Config keys allowed to differ between compared runs: the variant and what it implies, and
#: per-run bookkeeping (ids, output locations).
VARIANT_KEYS: frozenset[str] = frozenset(
    {"variant", "optimize", "run_id", "output_dir", "checkpoint_dir"}
)


class CompareError(DistoptError):
    """Runs cannot be compared (configs differ, too few steps, bad options)."""


@dataclasses.dataclass(kw_only=True, slots=True, frozen=True)
class RunSummary:
    """QPS statistics of one run after warm-up."""

    label: str
    """How the user named the run (its path)."""
    run_id: str
    variant: str
    world_size: int
    steps: int
    """Merged steps counted (after warm-up)."""
    warmup: int
    median_qps: float
    p10_qps: float
    p90_qps: float
    step_numbers: tuple[int, ...]
    """All merged step numbers (warm-up included), for plotting."""
    qps: tuple[float, ...]
    """Merged QPS of each step in ``step_numbers``."""
    median_step_time_s: float
    """Median job step time after warm-up (the slowest rank's, per step)."""
    predicted_step_time_s: float | None
    predicted_gain: float | None
    predicted_saving_s: float | None
    """The cost model's per-step saving over the unoptimized model, when the header has one (the
    jobs' mean, as ``predicted_step_time_s`` is, for several)."""
    phases: dict[str, float] | None = None
    """Median seconds of each measured step phase after warm-up (over every rank's steps), when
    the steps record them."""
    predicted_phases: dict[str, dict[str, float]] | None = None
    """The headers' per-phase prediction: ``{"baseline": {...}, "optimized": {...}}`` (each
    phase averaged over the jobs, for several)."""
    segments: tuple[tuple[float, ...], ...] = ()
    """QPS after warm-up of each job pooled into this run (one for a single job)."""
    jobs: int = 1
    """Jobs pooled into this run."""
    fetches: dict[str, float] | None = None
    """Parameter-server jobs, after warm-up over every rank's steps: the median ``rows_fetched``,
    ``bytes_fetched`` and (row caches) ``cache_hit_rate`` per step, and the largest
    ``cache_bytes`` and ``cache_staleness_max``; ``None`` when the steps record no fetches."""

    @property
    def measured_qps(self) -> np.ndarray:
        """QPS samples after warm-up (of every job, in order)."""
        if not self.segments:
            return np.asarray(self.qps[self.warmup :], dtype=float)
        return np.concatenate([np.asarray(seg, dtype=float) for seg in self.segments])


@dataclasses.dataclass(kw_only=True, slots=True, frozen=True)
class Gain:
    """One run's throughput relative to the baseline."""

    label: str
    median: float
    """Ratio of median QPS (run / baseline); over rounds, the geometric mean of the rounds'
    ratios."""
    ci_low: float
    ci_high: float
    predicted: float | None
    """The cost model's predicted gain, when the logs carry one."""
    over_rounds: RoundsGain | None = None
    """The gain's rounds, spread and repeat interval, when the interval is over rounds
    (:func:`rounds_interval`)."""
    unchanged_s: tuple[float, float] | None = None
    """Median seconds per step of the phases the rewrite does not change (:data:`UNCHANGED`),
    in the baseline and in this run, when both logged their phases."""

    @property
    def rounds(self) -> tuple[float, ...]:
        """Each round's gain (empty when the interval is not over rounds)."""
        return () if self.over_rounds is None else self.over_rounds.rounds

    @property
    def prediction_error(self) -> float | None:
        """The predicted gain over the measured one, less one (``None`` without a prediction)."""
        return None if self.predicted is None else self.predicted / self.median - 1

    @property
    def unchanged_differ(self) -> bool:
        """Whether those phases differ between the runs by more than :data:`UNCHANGED_SLACK`
        (and a millisecond): the host, not the rewrite, moved part of the measured gain."""
        if self.unchanged_s is None:
            return False
        base, run = self.unchanged_s
        return abs(base - run) > max(1e-3, UNCHANGED_SLACK * min(base, run))


UNCHANGED: tuple[str, ...] = ("data", "backward", "pushes", "optimizer")
"""Step phases the remote-call passes leave as they are (they rewrite the forward)."""
UNCHANGED_SLACK = 0.2
"""How far (relative) those phases may differ between two runs before ``compare`` says so."""


@dataclasses.dataclass(kw_only=True, slots=True, frozen=True)
class PhaseRow:
    """One phase of a step: predicted and measured seconds, for the baseline and one run."""

    label: str
    """The run whose header made the prediction."""
    phase: str
    baseline_predicted: float | None
    baseline_measured: float | None
    predicted: float | None
    measured: float | None

    @property
    def error(self) -> float | None:
        """Predicted over measured, less one (``None`` without both, or when both are under
        :data:`PHASE_FLOOR_S`: noise, not a term)."""
        if self.predicted is None or self.measured is None:
            return None
        if max(self.predicted, self.measured) < PHASE_FLOOR_S or self.measured <= 0:
            return None
        return self.predicted / self.measured - 1


@dataclasses.dataclass(kw_only=True, slots=True, frozen=True)
class Comparison:
    """Everything ``distopt compare`` shows."""

    runs: tuple[RunSummary, ...]
    gains: tuple[Gain, ...]
    """One per run after the baseline (``runs[0]``)."""
    config_diff: dict[str, dict[str, Any]]
    """Dotted config key → {run label: value}, for keys that differ (empty when compatible)."""
    forced: bool
    warmup: int
    level: float
    resamples: int
    seed: int
    block: int = DEFAULT_BLOCK
    phases: tuple[PhaseRow, ...] = ()
    """Predicted beside measured phases of every run whose header predicts them."""
    unfinished: tuple[str, ...] = ()
    """Jobs whose logs say they did not finish (compared with ``force``): one line each."""

    @property
    def interval(self) -> str:
        """How the gains' intervals were made, in words."""
        over_rounds = [gain.over_rounds for gain in self.gains if gain.over_rounds]
        parts = []
        if over_rounds:
            first = over_rounds[0]
            rounds = len(first.rounds)
            runs = f"{first.earlier_runs} earlier run{'s' * (first.earlier_runs > 1)}"
            if first.between_runs:
                pooled = (
                    f"their spread pooled with that of the rounds of {runs}, plus the part of "
                    f"the runs' gains' spread that the rounds' noise does not explain (one-way "
                    f"random effects; {first.degrees_of_freedom} degrees of freedom, from the "
                    "runs' gains)"
                )
            elif first.earlier_runs:
                pooled = (
                    f"their spread pooled with that of the rounds of {runs} "
                    f"({first.degrees_of_freedom} degrees of freedom in all)"
                )
            else:
                dof = first.degrees_of_freedom
                pooled = f"{dof} degree{'s' * (dof != 1)} of freedom"
            parts.append(
                f"{self.level:.0%} t interval over {rounds} rounds (the i-th job of each run "
                f"paired, in the order given) of the log of each round's ratio of medians, "
                f"{pooled}; the gain is their geometric mean; the repeat interval, √2 wider (two "
                f"runs' noise), is where another run of {rounds} rounds would measure"
                + (
                    " (from the rounds' noise alone: drift between runs enters from four runs on, "
                    "with earlier runs' rounds)"
                    if first.noise_alone
                    else ""
                )
            )
        if len(over_rounds) < len(self.gains):
            parts.append(
                f"{self.level:.0%} percentile bootstrap of the ratio of medians over blocks of "
                f"{self.block} consecutive steps ({self.resamples} resamples, seed {self.seed}); "
                + self._drift()
            )
        return "; ".join(parts)

    def _drift(self) -> str:
        if all(run.jobs == 1 for run in self.runs):
            return "drift of the host between the jobs is not in it"
        jobs = ", ".join(f"{run.jobs} {run.variant}" for run in self.runs)
        return f"steps pooled from alternated jobs ({jobs}), jobs resampled, then blocks in each"

    def to_json(self) -> dict[str, Any]:
        gains = {g.label: g for g in self.gains}
        runs = []
        for run in self.runs:
            gain = gains.get(run.label)
            runs.append(
                {
                    "label": run.label,
                    "run_id": run.run_id,
                    "variant": run.variant,
                    "world_size": run.world_size,
                    "steps": run.steps,
                    "jobs": run.jobs,
                    "median_qps": run.median_qps,
                    "p10_qps": run.p10_qps,
                    "p90_qps": run.p90_qps,
                    "gain": gain.median if gain else None,
                    "gain_ci_low": gain.ci_low if gain else None,
                    "gain_ci_high": gain.ci_high if gain else None,
                    "round_gains": list(gain.rounds) if gain and gain.rounds else None,
                    **_rounds_fields(gain.over_rounds if gain else None),
                    "predicted_gain": gain.predicted if gain else None,
                    "prediction_error": gain.prediction_error if gain else None,
                    "unchanged_phases_s": list(gain.unchanged_s)
                    if gain and gain.unchanged_s
                    else None,
                    "fetches": run.fetches,
                }
            )
        return {
            "baseline": self.runs[0].label,
            "warmup": self.warmup,
            "ci_level": self.level,
            "resamples": self.resamples,
            "seed": self.seed,
            "block": self.block,
            "interval": self.interval,
            "forced": self.forced,
            "config_diff": self.config_diff,
            "unfinished": list(self.unfinished),
            "runs": runs,
            "phases": [dataclasses.asdict(row) for row in self.phases],
        }


_ROUNDS_FIELDS = ("repeat_low", "repeat_high", "earlier_runs", "degrees_of_freedom", "between_runs")
"""What a gain over rounds adds to its run's JSON (``None`` for a gain that is not)."""


def _rounds_fields(rounds: RoundsGain | None) -> dict[str, Any]:
    return {name: None if rounds is None else getattr(rounds, name) for name in _ROUNDS_FIELDS}


def _optional_float(header: Mapping[str, Any], key: str, *, positive: bool = True) -> float | None:
    """``header[key]`` as a float (``None`` when absent); a one-line error unless it is a
    number, and with ``positive`` one above 0."""
    value = header.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (positive and value <= 0):
        kind = "a positive number" if positive else "a number"
        raise CompareError(f"header {key}: expected {kind}, got {value!r}")
    return float(value)


Jobs = RunLog | Sequence[RunLog]
"""One run, or several jobs of one variant whose steps are pooled (each after its own warm-up)."""


def _jobs(run: Jobs) -> list[RunLog]:
    jobs = [run] if isinstance(run, RunLog) else list(run)
    if not jobs:
        raise CompareError("a run of no jobs")
    return jobs


def summarize(run: Jobs, *, label: str, warmup: int = DEFAULT_WARMUP) -> RunSummary:
    """Median/p10/p90 of the merged QPS after ``warmup`` steps (of each job, for several)."""
    if warmup < 0:
        raise CompareError(f"--warmup: expected an integer >= 0, got {warmup}")
    jobs = _jobs(run)
    segments: list[tuple[float, ...]] = []
    merged: list[MergedStep] = []
    counted_steps: list[MergedStep] = []
    recorded: list[dict[str, float]] = []
    fetching: list[StepRecord] = []
    for job in jobs:
        steps = job.merged_steps()
        if len(steps) <= warmup:
            where = f" in {job.path}" if len(jobs) > 1 else ""
            raise CompareError(
                f"{label}: {len(steps)} complete steps{where}, none left after a warm-up of "
                f"{warmup} (lower --warmup or run more steps)"
            )
        merged += steps
        counted_steps += steps[warmup:]
        segments.append(tuple(float(m.qps) for m in steps[warmup:]))
        counted = {m.step for m in steps[warmup:]}
        recorded += [
            r.phases
            for rank in job.ranks.values()
            for r in rank.steps
            if r.step in counted and r.phases is not None
        ]
        fetching += [
            r
            for rank in job.ranks.values()
            for r in rank.steps
            if r.step in counted and r.rows_fetched is not None
        ]
    run = jobs[0]
    qps = np.asarray([m.qps for m in merged], dtype=float)
    measured = np.concatenate([np.asarray(seg) for seg in segments])
    step_times = np.asarray([m.step_time_s for m in counted_steps], dtype=float)
    median_step_s = float(np.median(step_times))
    phases = phase_medians(recorded, median_step_s) if recorded else None
    return RunSummary(
        label=label,
        run_id=run.run_id,
        variant=run.variant,
        world_size=run.world_size,
        steps=len(measured),
        warmup=warmup,
        median_qps=float(np.median(measured)),
        p10_qps=float(np.percentile(measured, 10)),
        p90_qps=float(np.percentile(measured, 90)),
        step_numbers=tuple(m.step for m in merged),
        qps=tuple(float(q) for q in qps),
        segments=tuple(segments),
        jobs=len(jobs),
        median_step_time_s=median_step_s,
        predicted_step_time_s=_jobs_mean(
            [_optional_float(job.header, "predicted_step_time_s") for job in jobs]
        ),
        predicted_gain=_jobs_gain(jobs),
        # A saving below 0 is a prediction too: the rewrite predicted to cost time.
        predicted_saving_s=_jobs_mean(
            [_optional_float(job.header, "predicted_saving_s", positive=False) for job in jobs]
        ),
        phases=phases,
        predicted_phases=_jobs_phases(jobs),
        fetches=_fetches(fetching),
    )


def _jobs_gain(jobs: Sequence[RunLog]) -> float | None:
    """The predicted gain of a run of several jobs: the geometric mean of their headers'
    predictions, as its measured gain is of its rounds' (each job predicted its own: the first
    job's alone moved the demo's prediction by 5.5% between two runs whose jobs' geometric means
    were 2.1% apart)."""
    predicted = [_optional_float(job.header, "predicted_gain") for job in jobs]
    known = [value for value in predicted if value is not None]
    if not known:
        return None
    return float(np.exp(np.mean(np.log(known))))


def shown_label(label: str, *, short: bool = False) -> str:
    """A run's label as printed: pooled jobs' paths (comma-joined) in brace form,
    ``dir/demo-baseline-{0,1,2}`` (what a shell would expand back to them), rather than every path
    in full; ``short``: without directories."""
    parts = label.split(",")
    if short:
        parts = [Path(part).name for part in parts]
    if len(parts) == 1:
        return parts[0]
    prefix = os.path.commonprefix(parts)
    return prefix + "{" + ",".join(part[len(prefix) :] for part in parts) + "}"


def _jobs_mean(values: Sequence[float | None]) -> float | None:
    """The mean of the jobs' predicted seconds that their headers have (``None``: none has)."""
    known = [value for value in values if value is not None]
    return float(np.mean(known)) if known else None


def _jobs_phases(jobs: Sequence[RunLog]) -> dict[str, dict[str, float]] | None:
    """The per-phase prediction of a run of several jobs: each phase's seconds averaged over the
    jobs whose headers predict it (as :func:`_jobs_mean` leaves out a job without a value), so
    that with the same phases in every header the predicted step (the phases' sum) is the mean of
    theirs; the first job's alone put one job's guess beside the measured medians of all."""
    predicted = [p for p in (_predicted_phases(job.header) for job in jobs) if p is not None]
    if not predicted:
        return None
    return {
        variant: {
            name: float(np.mean([p[variant][name] for p in predicted if name in p[variant]]))
            for name in dict.fromkeys(n for p in predicted for n in p[variant])
        }
        for variant in ("baseline", "optimized")
    }


def _fetches(steps: Sequence[StepRecord]) -> dict[str, float] | None:
    """What :attr:`RunSummary.fetches` says of ``steps``."""
    if not steps:
        return None
    found: dict[str, float] = {}
    for key in ("rows_fetched", "bytes_fetched", "cache_hit_rate"):
        values = [getattr(r, key) for r in steps if getattr(r, key) is not None]
        if values:
            found[key] = float(np.median(values))
    for key in ("cache_bytes", "cache_staleness_max"):
        values = [getattr(r, key) for r in steps if getattr(r, key) is not None]
        if values:
            found[key] = float(max(values))
    return found


def _predicted_phases(header: Mapping[str, Any]) -> dict[str, dict[str, float]] | None:
    value = header.get("predicted_phases")
    if value is None:
        return None
    try:
        return {
            variant: {str(k): float(v) for k, v in value[variant].items()}
            for variant in ("baseline", "optimized")
        }
    except (TypeError, KeyError, AttributeError, ValueError):
        raise CompareError(
            f"header predicted_phases: expected baseline and optimized phase seconds, got {value!r}"
        ) from None


def bootstrap_ratio_of_medians(
    baseline: Samples,
    candidate: Samples,
    *,
    resamples: int = DEFAULT_RESAMPLES,
    level: float = DEFAULT_LEVEL,
    seed: int = DEFAULT_SEED,
    block: int = 1,
) -> tuple[float, float, float]:
    """``(median(candidate) / median(baseline), ci_low, ci_high)`` by a percentile bootstrap
    that resamples blocks of ``block`` consecutive samples (1: single samples). Either side may
    be a list of segments (the jobs of a pooled run): no block spans two of them, and the
    segments are resampled first (:func:`_resampled_medians`)."""
    _check_level(level)
    if resamples < 1:
        raise CompareError(f"--resamples: expected an integer >= 1, got {resamples}")
    if block < 1:
        raise CompareError(f"--block: expected an integer >= 1, got {block}")
    rng = np.random.default_rng(seed)
    ratios = _resampled_medians(candidate, rng, resamples, block) / _resampled_medians(
        baseline, rng, resamples, block
    )
    tail = (1 - level) / 2
    low, high = np.quantile(ratios, [tail, 1 - tail])
    point = np.median(np.concatenate(_segments(candidate))) / np.median(
        np.concatenate(_segments(baseline))
    )
    return float(point), float(low), float(high)


def _check_level(level: float) -> None:
    if not 0 < level < 1:
        raise CompareError(f"--ci-level: expected a number in (0, 1), got {level}")


Samples = np.ndarray | Sequence[np.ndarray]
"""Samples, or segments of them (blocks never span two)."""


def _segments(samples: Samples) -> list[np.ndarray]:
    if isinstance(samples, np.ndarray):
        return [samples]
    return [np.asarray(seg, dtype=float) for seg in samples]


def _resampled_medians(
    samples: Samples, rng: np.random.Generator, resamples: int, block: int
) -> np.ndarray:
    """Medians of ``resamples`` resamples of ``samples``: with one segment, as many whole blocks
    (of ``block`` consecutive samples; the last may be short) drawn with replacement as it has;
    with several, a two-stage bootstrap: as many segments drawn with replacement as there are,
    then each drawn segment's blocks drawn within it (the spread between segments is in it)."""
    segments = [
        [seg[i : i + block] for i in range(0, len(seg), block)] for seg in _segments(samples)
    ]
    medians = np.empty(resamples)
    for r in range(resamples):
        drawn = rng.integers(0, len(segments), size=len(segments)) if len(segments) > 1 else [0]
        parts = []
        for s in drawn:
            blocks = segments[s]
            parts += [blocks[i] for i in rng.integers(0, len(blocks), size=len(blocks))]
        medians[r] = np.median(np.concatenate(parts))
    return medians


@dataclasses.dataclass(kw_only=True, slots=True, frozen=True)
class RoundsGain:
    """A gain measured over paired rounds (:func:`rounds_interval`)."""

    gain: float
    """The geometric mean of the rounds' gains."""
    ci_low: float
    """The gain's confidence interval: its lower bound."""
    ci_high: float
    repeat_low: float
    """The repeat interval (a prediction interval): where another run of as many rounds would
    measure its gain; its lower bound."""
    repeat_high: float
    rounds: tuple[float, ...]
    earlier_runs: int
    """Earlier runs of the same comparison that the spread was estimated with."""
    degrees_of_freedom: int
    between_runs: bool = False
    """Whether the runs' gains spread more than their rounds' noise explains, so that the
    variance of a run's gain has a between-run part (:func:`rounds_interval`)."""

    @property
    def noise_alone(self) -> bool:
        """Whether the intervals hold the rounds' noise alone: too few runs to estimate a
        between-run part (:data:`MIN_RUNS_BETWEEN`)."""
        return self.earlier_runs + 1 < MIN_RUNS_BETWEEN


MIN_RUNS_BETWEEN = 4
"""Runs (this one and earlier ones) from which a between-run part of the variance is estimated:
three degrees of freedom at least."""


def pooled_spread(runs: Sequence[Sequence[float]]) -> tuple[float, int]:
    """``(s, degrees of freedom)``: the standard deviation of the runs' round log-gains, each
    about its own run's mean, pooled. Each run contributes its rounds less one; a run's mean does
    not enter (:func:`rounds_interval` weighs the runs' means apart)."""
    arrays = [np.asarray(run, dtype=float) for run in runs]
    squares = sum(float(((r - r.mean()) ** 2).sum()) for r in arrays)
    dof = sum(len(r) - 1 for r in arrays)
    return float(np.sqrt(squares / dof)), dof


def rounds_interval(
    baseline: Sequence[np.ndarray],
    candidate: Sequence[np.ndarray],
    *,
    level: float = DEFAULT_LEVEL,
    earlier: Sequence[Sequence[float]] = (),
) -> RoundsGain:
    """The gain over paired rounds: round ``i`` is the ``i``-th job of each side, its gain
    ``median(candidate[i]) / median(baseline[i])``; the gain is their geometric mean and its
    intervals Student t intervals on the log scale. Drift slower than a round cancels within it.

    The variance of a run's mean log-gain is the rounds' spread (pooled with ``earlier`` runs'
    round gains, :func:`pooled_spread`) over the rounds, plus, from :data:`MIN_RUNS_BETWEEN` runs
    on, a between-run part: a one-way random-effects estimate, the runs' means' variance less
    what their rounds' noise explains, counted when positive (``runs - 1`` degrees of freedom
    then: the estimate rests on the runs' means). Four rounds alone give three degrees of
    freedom, and rounds that agree by chance a narrow interval: two demo runs two minutes apart,
    each's rounds within ±2%, measured 1.630× and 1.793×. The confidence interval is the gain's;
    the repeat interval (√2 wider: both runs' means are noisy) is where another run of as many
    rounds would measure."""
    _check_level(level)
    if len(baseline) != len(candidate) or len(baseline) < 2:
        raise CompareError(
            f"rounds need two or more jobs on each side, as many of each: got {len(baseline)} "
            f"and {len(candidate)}"
        )
    for gains_of_run in earlier:
        _check_earlier(gains_of_run)
    gains = np.asarray(
        [np.median(c) / np.median(b) for b, c in zip(baseline, candidate, strict=True)]
    )
    logs = np.log(gains)
    runs = [logs, *(np.log(np.asarray(g, dtype=float)) for g in earlier)]
    spread, dof = pooled_spread(runs)
    variance = spread**2 / len(logs)
    between = False
    if len(runs) >= MIN_RUNS_BETWEEN:
        means = [float(r.mean()) for r in runs]
        noise = spread**2 * float(np.mean([1 / len(r) for r in runs]))
        between_part = float(np.var(means, ddof=1)) - noise
        if between_part > 0:
            variance, dof, between = variance + between_part, len(runs) - 1, True
    half = float(scipy.stats.t.ppf((1 + level) / 2, dof)) * np.sqrt(variance)
    mean = float(logs.mean())
    return RoundsGain(
        gain=float(np.exp(mean)),
        ci_low=float(np.exp(mean - half)),
        ci_high=float(np.exp(mean + half)),
        repeat_low=float(np.exp(mean - half * np.sqrt(2.0))),
        repeat_high=float(np.exp(mean + half * np.sqrt(2.0))),
        rounds=tuple(float(g) for g in gains),
        earlier_runs=len(earlier),
        degrees_of_freedom=dof,
        between_runs=between,
    )


def _check_earlier(gains: Sequence[float]) -> None:
    shown = ",".join(f"{g:g}" for g in gains)
    if len(gains) < 2:
        raise CompareError(f"earlier rounds {shown or '(none)'}: a run needs two or more rounds")
    if not all(np.isfinite(g) and g > 0 for g in gains):
        raise CompareError(f"earlier rounds {shown}: gains must be positive numbers")


def _flatten(config: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in config.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            flat.update(_flatten(value, dotted + "."))
        else:
            flat[dotted] = value
    return flat


def config_diff(runs: Sequence[RunLog], labels: Sequence[str]) -> dict[str, dict[str, Any]]:
    """Keys (dotted) whose values differ between runs, ignoring :data:`VARIANT_KEYS`.

    The trainer world size is compared too (it lives in the header, not the config). A key absent
    from a run shows as ``None`` for that run.
    """
    flats = []
    for run in runs:
        flat = {
            k: v for k, v in _flatten(run.config).items() if k.split(".")[0] not in VARIANT_KEYS
        }
        flat["world_size"] = run.world_size
        flats.append(flat)
    diff: dict[str, dict[str, Any]] = {}
    for key in sorted(set().union(*flats)):
        values = [flat.get(key) for flat in flats]
        if any(v != values[0] for v in values[1:]):
            diff[key] = dict(zip(labels, values, strict=True))
    return diff


def compare_runs(
    runs: Sequence[Jobs],
    *,
    labels: Sequence[str] | None = None,
    warmup: int = DEFAULT_WARMUP,
    force: bool = False,
    resamples: int = DEFAULT_RESAMPLES,
    level: float = DEFAULT_LEVEL,
    seed: int = DEFAULT_SEED,
    block: int = DEFAULT_BLOCK,
    earlier_rounds: Sequence[Sequence[float]] = (),
) -> Comparison:
    """Compare ``runs`` against ``runs[0]`` (the baseline). A run may be several jobs of one
    variant (alternated with the other variant's, so that host drift cannot favour either): their
    steps are pooled for the QPS statistics; the gain is over rounds when both runs have as many
    jobs (:func:`rounds_interval`, the rounds' spread pooled with ``earlier_rounds``: the round
    gains of earlier runs of the same comparison on the same host), else a two-stage bootstrap of
    jobs and their blocks.

    Raises :class:`CompareError` when fewer than two runs are given, or, unless ``force``, when
    their configs differ in more than the variant (the message lists the differing keys) or a job
    did not finish (its QPS is of part of a run: its log's footer says how it ended).
    """
    if len(runs) < 2:
        raise CompareError(f"need at least two runs to compare, got {len(runs)}")
    if earlier_rounds and len(runs) > 2:
        raise CompareError(
            "earlier rounds: only with one run beside the baseline (they are the rounds of that "
            f"comparison), got {len(runs) - 1}"
        )
    for gains_of_run in earlier_rounds:
        _check_earlier(gains_of_run)
    pooled = [_jobs(run) for run in runs]
    labels = [str(jobs[0].path) for jobs in pooled] if labels is None else list(labels)
    job_labels = [
        label if len(jobs) == 1 else f"{label}[{i}]"
        for label, jobs in zip(labels, pooled, strict=True)
        for i in range(len(jobs))
    ]
    diff = config_diff([job for jobs in pooled for job in jobs], job_labels)
    if diff and not force:
        keys = ", ".join(diff)
        raise CompareError(
            f"run configs differ in more than the variant: {keys} (use --force to compare anyway)"
        )
    unfinished = tuple(line for jobs in pooled for job in jobs if (line := _unfinished(job)))
    if unfinished and not force:
        raise CompareError(
            f"{unfinished[0]}: its QPS is of part of a run (use --force to compare anyway)"
        )
    summaries = [
        summarize(run, label=label, warmup=warmup) for run, label in zip(runs, labels, strict=True)
    ]
    base = summaries[0]
    gains = []
    for summary in summaries[1:]:
        base_jobs = [np.asarray(seg) for seg in base.segments]
        jobs = [np.asarray(seg) for seg in summary.segments]
        over_rounds: RoundsGain | None = None
        if len(jobs) == len(base_jobs) >= 2:
            over_rounds = rounds_interval(base_jobs, jobs, level=level, earlier=earlier_rounds)
            median, low, high = over_rounds.gain, over_rounds.ci_low, over_rounds.ci_high
        else:
            median, low, high = bootstrap_ratio_of_medians(
                base_jobs, jobs, resamples=resamples, level=level, seed=seed, block=block
            )
        gains.append(
            Gain(
                label=summary.label,
                median=median,
                ci_low=low,
                ci_high=high,
                over_rounds=over_rounds,
                predicted=predicted_gain(base, summary),
                unchanged_s=_unchanged(base, summary),
            )
        )
    return Comparison(
        runs=tuple(summaries),
        gains=tuple(gains),
        config_diff=diff,
        forced=force,
        warmup=warmup,
        level=level,
        resamples=resamples,
        seed=seed,
        block=block,
        phases=tuple(row for run in summaries[1:] for row in phase_rows(base, run)),
        unfinished=unfinished,
    )


def _unfinished(job: RunLog) -> str | None:
    """How ``job`` ended when a rank's footer says it did not finish (``None``: every rank that
    wrote a footer finished; a log without one may still be running)."""
    for rank, log in sorted(job.ranks.items()):
        footer = log.footer or {}
        status = footer.get("status", "ok")
        if status != "ok":
            planned = job.config.get("steps")
            of = f" of {planned}" if planned is not None else ""
            error = str(footer.get("error") or "").strip().splitlines()
            why = f" ({error[0]})" if error else ""
            return (
                f"{job.path}: rank {rank} {status} after {footer.get('steps', '?')}{of} steps{why}"
            )
    return None


def _unchanged(base: RunSummary, run: RunSummary) -> tuple[float, float] | None:
    if base.phases is None or run.phases is None:
        return None
    return (
        sum(base.phases.get(name, 0.0) for name in UNCHANGED),
        sum(run.phases.get(name, 0.0) for name in UNCHANGED),
    )


def phase_rows(base: RunSummary, run: RunSummary) -> list[PhaseRow]:
    """``run``'s per-phase prediction (for the model as written and as optimized) beside the
    measured phases of ``base`` and ``run``; empty when ``run``'s header predicts none."""
    predicted = run.predicted_phases
    if predicted is None:
        return []
    names = list(predicted["optimized"])
    names += [n for n in (run.phases or {}) if n not in names]
    rows = [
        PhaseRow(
            label=run.label,
            phase=name,
            baseline_predicted=predicted["baseline"].get(name),
            baseline_measured=(base.phases or {}).get(name),
            predicted=predicted["optimized"].get(name),
            measured=(run.phases or {}).get(name),
        )
        for name in names
    ]
    # The step: the sum of the rows above on the predicted side, the median step measured.
    rows.append(
        PhaseRow(
            label=run.label,
            phase=STEP_ROW,
            baseline_predicted=StepPrediction.total(predicted["baseline"]),
            baseline_measured=base.median_step_time_s,
            predicted=StepPrediction.total(predicted["optimized"]),
            measured=run.median_step_time_s,
        )
    )
    return rows


STEP_ROW = "step"
"""The last row of a per-phase report: the whole step."""


def predicted_gain(base: RunSummary, run: RunSummary) -> float | None:
    """The cost model's gain of ``run`` over ``base``.

    Preferred: the header's ``predicted_gain`` when it predicted every phase of the step
    (``predicted_phases``): a prediction of both steps, made before either was measured. Then,
    for older logs: the run's predicted per-step saving subtracted from the baseline run's *measured*
    median step time. That step includes everything the cost model does not see (gradient pushes,
    all-reduce, other processes on the host), which a prediction made inside the trainer from a
    lone forward+backward overstates the gain by. Then a header's ``predicted_gain``; then the
    ratio of predicted step times when both runs have one.
    """
    if run.predicted_phases is not None and run.predicted_gain is not None:
        return run.predicted_gain
    if run.predicted_saving_s is not None and run is not base:
        after = base.median_step_time_s - run.predicted_saving_s
        # A saving as large as the whole step cannot be right; say nothing rather than infinity.
        return base.median_step_time_s / after if after > 0 else None
    if run.predicted_gain is not None:
        return run.predicted_gain
    if run.predicted_step_time_s is not None and base.predicted_step_time_s is not None:
        return base.predicted_step_time_s / run.predicted_step_time_s
    return None


def failed_gains(comparison: Comparison, threshold: float, *, stat: str = "ci_low") -> list[Gain]:
    """Gains whose ``stat`` (``"ci_low"``: the CI's lower bound; ``"median"``) is below ``threshold``."""
    if stat not in ("ci_low", "median"):
        raise CompareError(f"--assert-stat: expected 'ci_low' or 'median', got {stat!r}")
    return [g for g in comparison.gains if getattr(g, stat) < threshold]


def mispredicted(comparison: Comparison, tolerance: float) -> list[Gain]:
    """Gains whose prediction is off the measured gain by more than ``tolerance`` (relative);
    a run without a prediction is one of them (nothing to trust)."""
    if not tolerance >= 0:
        raise CompareError(f"--assert-prediction: expected a fraction >= 0, got {tolerance!r}")
    return [
        g
        for g in comparison.gains
        if g.prediction_error is None or abs(g.prediction_error) > tolerance
    ]
