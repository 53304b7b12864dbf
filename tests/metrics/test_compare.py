"""Compare statistics on synthetic runs with known QPS distributions."""

from __future__ import annotations

import numpy as np
import pytest

from distopt.metrics.compare import (
    CompareError,
    bootstrap_ratio_of_medians,
    compare_runs,
    failed_gains,
    summarize,
)
from distopt.metrics.qps_log import load_run
from tests.metrics.synthetic import WriteRun


def test_ten_percent_faster_run_has_gain_ci_around_1_10(write_run: WriteRun) -> None:
    base = load_run(write_run("base", 1000.0, seed=1))
    fast = load_run(write_run("fast", 1100.0, variant="optimized", seed=2))
    result = compare_runs([base, fast], labels=["base", "fast"])
    (gain,) = result.gains
    assert gain.label == "fast"
    assert gain.ci_low < 1.10 < gain.ci_high
    assert gain.ci_low > 1.0  # the gain is real
    assert gain.ci_low <= gain.median <= gain.ci_high
    assert abs(gain.median - 1.10) < 0.02
    assert result.level == 0.95 and result.resamples == 2000


def test_equal_runs_have_gain_ci_containing_one(write_run: WriteRun) -> None:
    a = load_run(write_run("a", 1000.0, seed=3))
    b = load_run(write_run("b", 1000.0, seed=4))
    (gain,) = compare_runs([a, b]).gains
    assert gain.ci_low < 1.0 < gain.ci_high


def test_bootstrap_interval_covers_true_ratio_at_about_its_level() -> None:
    """Over repeated experiments the 95% interval contains the true ratio most of the time."""
    rng = np.random.default_rng(7)
    covered = 0
    trials = 60
    for trial in range(trials):
        base = rng.normal(1000, 50, 150)
        cand = rng.normal(1200, 60, 150)
        _, low, high = bootstrap_ratio_of_medians(base, cand, resamples=1000, seed=trial)
        covered += low < 1.2 < high
    assert covered / trials >= 0.85


def test_bootstrap_is_deterministic_for_a_seed() -> None:
    rng = np.random.default_rng(0)
    base, cand = rng.normal(10, 1, 50), rng.normal(11, 1, 50)
    assert bootstrap_ratio_of_medians(base, cand, seed=5) == bootstrap_ratio_of_medians(
        base, cand, seed=5
    )
    assert bootstrap_ratio_of_medians(base, cand, seed=5) != bootstrap_ratio_of_medians(
        base, cand, seed=6
    )


def test_summary_drops_warmup_and_reports_percentiles(write_run: WriteRun) -> None:
    run = load_run(write_run("r", 1000.0, steps=50, seed=5))
    summary = summarize(run, label="r", warmup=10)
    measured = np.array([m.qps for m in run.merged_steps()][10:])
    assert summary.steps == 40 and len(summary.qps) == 50
    assert summary.median_qps == pytest.approx(np.median(measured))
    assert summary.p10_qps == pytest.approx(np.percentile(measured, 10))
    assert summary.p90_qps == pytest.approx(np.percentile(measured, 90))
    assert summary.p10_qps < summary.median_qps < summary.p90_qps
    with pytest.raises(CompareError, match="r: 50 complete steps, none left after a warm-up of 50"):
        summarize(run, label="r", warmup=50)


def test_configs_differing_beyond_variant_are_refused(write_run: WriteRun) -> None:
    base = load_run(write_run("base", 1000.0))
    same = load_run(
        write_run("opt", 1100.0, variant="optimized", config={"optimize": True, "output_dir": "x"})
    )
    compare_runs([base, same])  # variant, optimize, run id and output dir may differ
    other = load_run(write_run("lr", 1000.0, config={"lr": 0.1, "model_kwargs": {"hidden": 32}}))
    with pytest.raises(CompareError) as info:
        compare_runs([base, other])
    assert "differ in more than the variant: lr, model_kwargs.hidden" in str(info.value)
    assert "--force" in str(info.value)
    forced = compare_runs([base, other], labels=["base", "lr"], force=True)
    assert forced.forced and forced.config_diff["lr"] == {"base": 0.01, "lr": 0.1}


def test_world_size_difference_is_a_config_difference(write_run: WriteRun) -> None:
    one = load_run(write_run("one", 1000.0))
    two = load_run(write_run("two", 1000.0, world_size=2))
    with pytest.raises(CompareError, match="world_size"):
        compare_runs([one, two])


def test_predicted_gain_from_header(write_run: WriteRun) -> None:
    base = load_run(write_run("base", 1000.0, extra={"predicted_step_time_s": 0.08}))
    opt = load_run(write_run("opt", 1100.0, extra={"predicted_step_time_s": 0.05}))
    stated = load_run(write_run("stated", 1100.0, extra={"predicted_gain": 1.25}))
    plain = load_run(write_run("plain", 1100.0))
    result = compare_runs([base, opt, stated, plain], labels=["b", "o", "s", "p"])
    predicted = {g.label: g.predicted for g in result.gains}
    assert predicted == {"o": pytest.approx(1.6), "s": 1.25, "p": None}


def test_predicted_saving_is_taken_off_the_measured_baseline_step(write_run: WriteRun) -> None:
    base = load_run(write_run("base", 1000.0, extra={"predicted_step_time_s": 0.08}))
    saving = load_run(
        write_run("saving", 1500.0, extra={"predicted_saving_s": 0.02, "predicted_gain": 9.0})
    )
    absurd = load_run(write_run("absurd", 1500.0, extra={"predicted_saving_s": 100.0}))
    result = compare_runs([base, saving, absurd], labels=["b", "s", "a"])
    t_base = result.runs[0].median_step_time_s
    predicted = {g.label: g.predicted for g in result.gains}
    assert predicted["s"] == pytest.approx(t_base / (t_base - 0.02))  # not the header's 9.0
    assert predicted["a"] is None


def test_failed_gains_uses_lower_bound_or_median(write_run: WriteRun) -> None:
    base = load_run(write_run("base", 1000.0, seed=1))
    fast = load_run(write_run("fast", 1100.0, seed=2))
    result = compare_runs([base, fast])
    (gain,) = result.gains
    assert failed_gains(result, 1.05) == []
    between = (gain.ci_low + gain.median) / 2  # above the lower bound, below the median
    assert failed_gains(result, between, stat="ci_low") == [gain]
    assert failed_gains(result, between, stat="median") == []


def test_fewer_than_two_runs(write_run: WriteRun) -> None:
    with pytest.raises(CompareError, match="at least two runs"):
        compare_runs([load_run(write_run("a", 1000.0))])
