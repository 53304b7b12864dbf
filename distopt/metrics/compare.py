"""Compare runs from their QPS logs: summary statistics, gain vs a baseline with a bootstrap CI,
the cost model's prediction, and a config check that the runs differ only in their variant.

Statistics use the merged (job-wide) QPS of each step after ``warmup`` steps; see
:meth:`distopt.metrics.qps_log.RunLog.merged_steps`.

Gain of run R vs baseline B = median QPS(R) / median QPS(B) (> 1 means R is faster). Its confidence
interval is a percentile bootstrap: each run's post-warm-up QPS samples are resampled with
replacement independently, the ratio of medians is recomputed ``resamples`` times, and the
``(1 - level) / 2`` and ``(1 + level) / 2`` quantiles bound the interval. Steps are treated as
independent samples; slow drifts (thermal, noisy neighbours) violate that, which is why jobs should
run long enough for several drift periods or be interleaved.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from distopt.errors import DistoptError
from distopt.metrics.records import RunLog

DEFAULT_WARMUP = 5
DEFAULT_RESAMPLES = 2000
DEFAULT_LEVEL = 0.95
DEFAULT_SEED = 0

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
    """The cost model's per-step saving over the unoptimized model, when the header has one."""

    @property
    def measured_qps(self) -> np.ndarray:
        """QPS samples after warm-up."""
        return np.asarray(self.qps[self.warmup :], dtype=float)


@dataclasses.dataclass(kw_only=True, slots=True, frozen=True)
class Gain:
    """One run's throughput relative to the baseline."""

    label: str
    median: float
    """Ratio of median QPS (run / baseline)."""
    ci_low: float
    ci_high: float
    predicted: float | None
    """The cost model's predicted gain, when the logs carry one."""


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
                    "median_qps": run.median_qps,
                    "p10_qps": run.p10_qps,
                    "p90_qps": run.p90_qps,
                    "gain": gain.median if gain else None,
                    "gain_ci_low": gain.ci_low if gain else None,
                    "gain_ci_high": gain.ci_high if gain else None,
                    "predicted_gain": gain.predicted if gain else None,
                }
            )
        return {
            "baseline": self.runs[0].label,
            "warmup": self.warmup,
            "ci_level": self.level,
            "resamples": self.resamples,
            "seed": self.seed,
            "forced": self.forced,
            "config_diff": self.config_diff,
            "runs": runs,
        }


def _optional_float(header: Mapping[str, Any], key: str) -> float | None:
    value = header.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise CompareError(f"header {key}: expected a positive number, got {value!r}")
    return float(value)


def summarize(run: RunLog, *, label: str, warmup: int = DEFAULT_WARMUP) -> RunSummary:
    """Median/p10/p90 of the merged QPS after ``warmup`` steps."""
    if warmup < 0:
        raise CompareError(f"--warmup: expected an integer >= 0, got {warmup}")
    merged = run.merged_steps()
    if len(merged) <= warmup:
        raise CompareError(
            f"{label}: {len(merged)} complete steps, none left after a warm-up of {warmup} "
            "(lower --warmup or run more steps)"
        )
    qps = np.asarray([m.qps for m in merged], dtype=float)
    measured = qps[warmup:]
    step_times = np.asarray([m.step_time_s for m in merged[warmup:]], dtype=float)
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
        median_step_time_s=float(np.median(step_times)),
        predicted_step_time_s=_optional_float(run.header, "predicted_step_time_s"),
        predicted_gain=_optional_float(run.header, "predicted_gain"),
        predicted_saving_s=_optional_float(run.header, "predicted_saving_s"),
    )


def bootstrap_ratio_of_medians(
    baseline: np.ndarray,
    candidate: np.ndarray,
    *,
    resamples: int = DEFAULT_RESAMPLES,
    level: float = DEFAULT_LEVEL,
    seed: int = DEFAULT_SEED,
) -> tuple[float, float, float]:
    """``(median(candidate) / median(baseline), ci_low, ci_high)`` by a percentile bootstrap."""
    if not 0 < level < 1:
        raise CompareError(f"--ci-level: expected a number in (0, 1), got {level}")
    if resamples < 1:
        raise CompareError(f"--resamples: expected an integer >= 1, got {resamples}")
    rng = np.random.default_rng(seed)
    base_idx = rng.integers(0, len(baseline), size=(resamples, len(baseline)))
    cand_idx = rng.integers(0, len(candidate), size=(resamples, len(candidate)))
    ratios = np.median(candidate[cand_idx], axis=1) / np.median(baseline[base_idx], axis=1)
    tail = (1 - level) / 2
    low, high = np.quantile(ratios, [tail, 1 - tail])
    return float(np.median(candidate) / np.median(baseline)), float(low), float(high)


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
    runs: Sequence[RunLog],
    *,
    labels: Sequence[str] | None = None,
    warmup: int = DEFAULT_WARMUP,
    force: bool = False,
    resamples: int = DEFAULT_RESAMPLES,
    level: float = DEFAULT_LEVEL,
    seed: int = DEFAULT_SEED,
) -> Comparison:
    """Compare ``runs`` against ``runs[0]`` (the baseline).

    Raises :class:`CompareError` when fewer than two runs are given, or when their configs differ
    in more than the variant and ``force`` is false (the message lists the differing keys).
    """
    if len(runs) < 2:
        raise CompareError(f"need at least two runs to compare, got {len(runs)}")
    labels = [str(r.path) for r in runs] if labels is None else list(labels)
    diff = config_diff(runs, labels)
    if diff and not force:
        keys = ", ".join(diff)
        raise CompareError(
            f"run configs differ in more than the variant: {keys} (use --force to compare anyway)"
        )
    summaries = [
        summarize(run, label=label, warmup=warmup) for run, label in zip(runs, labels, strict=True)
    ]
    base = summaries[0]
    gains = []
    for summary in summaries[1:]:
        median, low, high = bootstrap_ratio_of_medians(
            base.measured_qps, summary.measured_qps, resamples=resamples, level=level, seed=seed
        )
        gains.append(
            Gain(
                label=summary.label,
                median=median,
                ci_low=low,
                ci_high=high,
                predicted=predicted_gain(base, summary),
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
    )


def predicted_gain(base: RunSummary, run: RunSummary) -> float | None:
    """The cost model's gain of ``run`` over ``base``.

    Preferred: the run's predicted per-step saving subtracted from the baseline run's *measured*
    median step time. That step includes everything the cost model does not see (gradient pushes,
    all-reduce, other processes on the host), which a prediction made inside the trainer from a
    lone forward+backward overstates the gain by. Then a header's ``predicted_gain``; then the
    ratio of predicted step times when both runs have one.
    """
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
