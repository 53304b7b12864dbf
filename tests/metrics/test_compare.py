"""Compare statistics on synthetic runs with known QPS distributions."""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import scipy.stats
from hypothesis import given
from hypothesis import strategies as st

from distopt.cli import main
from distopt.estimate.step import PHASES
from distopt.metrics.compare import (
    CompareError,
    bootstrap_ratio_of_medians,
    compare_runs,
    failed_gains,
    mispredicted,
    pooled_spread,
    rounds_interval,
    shown_label,
    summarize,
)
from distopt.metrics.plot import jobs_apart
from distopt.metrics.qps_log import QpsLogWriter, load_run
from tests.metrics.synthetic import CONFIG, WriteRun


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
    # A rewrite predicted to cost time (examples/own_model's forward: -0.4 ms) is a prediction,
    # not a broken header: distopt demo's compare refused it.
    loss = load_run(write_run("loss", 1000.0, extra={"predicted_saving_s": -0.0004}))
    result = compare_runs([base, saving, absurd, loss], labels=["b", "s", "a", "l"])
    t_base = result.runs[0].median_step_time_s
    predicted = {g.label: g.predicted for g in result.gains}
    assert predicted["s"] == pytest.approx(t_base / (t_base - 0.02))  # not the header's 9.0
    assert predicted["a"] is None
    assert predicted["l"] == pytest.approx(t_base / (t_base + 0.0004)) and predicted["l"] < 1
    broken = load_run(write_run("broken", 1000.0, extra={"predicted_saving_s": "fast"}))
    with pytest.raises(
        CompareError, match="header predicted_saving_s: expected a number, got 'fast'"
    ):
        compare_runs([base, broken])


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


def _phased_run(
    out: Path, run_id: str, variant: str, phases: dict[str, float], **extra: Any
) -> Path:
    """A run whose every step records ``phases`` (seconds); its step time is their sum."""
    with QpsLogWriter.create(
        out,
        run_id=run_id,
        variant=variant,
        rank=0,
        world_size=1,
        global_batch_size=64,
        config={"model": "dlrm", "variant": variant, "run_id": run_id},
        extra=extra,
    ) as writer:
        for step in range(30):
            jitter = 1 + 0.01 * (step % 3)
            scaled = {k: v * jitter for k, v in phases.items()}
            total = sum(v for k, v in scaled.items() if k in PHASES)
            writer.log_step(step, total, phases=scaled)
    return out / run_id


def test_phases_predicted_beside_measured(tmp_path: Path) -> None:
    measured_base = {
        "data": 0.0,
        "forward": 0.030,
        "waits": 0.028,
        "backward": 0.004,
        "all_reduce": 0.001,
        "pushes": 0.010,
        "optimizer": 0.001,
    }
    measured_opt = {**measured_base, "forward": 0.012, "waits": 0.010}
    predicted = {
        "baseline": {**measured_base, "forward": 0.024},
        "optimized": {**measured_opt, "pushes": 0.008},
        "how": {"forward": "profiled"},
    }
    base = load_run(_phased_run(tmp_path, "base", "baseline", measured_base))
    opt = load_run(
        _phased_run(
            tmp_path,
            "opt",
            "optimized",
            measured_opt,
            predicted_phases=predicted,
            predicted_gain=1.6,
            predicted_saving_s=0.5,
        )
    )
    result = compare_runs([base, opt], labels=["b", "o"], warmup=3)
    rows = {row.phase: row for row in result.phases}
    assert list(rows) == [*measured_opt, "other", "step"]
    # Every step is its phases' sum, scaled alike: the medians add up and nothing is left over.
    assert rows["other"].measured == pytest.approx(0.0, abs=1e-12)
    assert rows["other"].predicted is None  # a header from before the rehearsal reported it
    assert rows["step"].predicted == pytest.approx(sum(predicted["optimized"][n] for n in PHASES))
    assert rows["step"].measured == result.runs[1].median_step_time_s
    assert rows["forward"].baseline_predicted == 0.024
    assert rows["forward"].baseline_measured == pytest.approx(0.030, rel=0.02)
    assert rows["forward"].measured == pytest.approx(0.012, rel=0.02)
    assert rows["pushes"].error == pytest.approx(0.008 / rows["pushes"].measured - 1)
    assert rows["data"].error is None  # nothing measured: no ratio
    # The whole-step prediction is the header's, not the saving taken off the measured baseline.
    assert result.gains[0].predicted == 1.6
    assert result.to_json()["phases"][1]["phase"] == "forward"
    old = load_run(_phased_run(tmp_path, "old", "optimized", measured_opt))
    assert compare_runs([base, old], warmup=3).phases == ()


def test_other_is_what_the_phase_medians_leave_of_the_median_step(tmp_path: Path) -> None:
    """Phases that vary together do not add up by their medians: steps that are long in their
    forward or in their push, and short ones, have a median step of 11 ms and phase medians of
    1 ms each; ``other`` holds the 9 ms."""
    shapes = [(0.010, 0.001), (0.001, 0.010), (0.001, 0.001)]
    with QpsLogWriter.create(
        tmp_path,
        run_id="r",
        variant="optimized",
        rank=0,
        world_size=1,
        global_batch_size=64,
        config={"model": "dlrm", "variant": "optimized", "run_id": "r"},
    ) as writer:
        for step in range(30):
            forward, pushes = shapes[step % 3]
            phases = {"data": 0.0, "forward": forward, "backward": 0.0, "pushes": pushes}
            writer.log_step(step, forward + pushes, phases=phases)
    summary = summarize(load_run(tmp_path / "r"), label="r", warmup=0)
    assert summary.phases is not None
    assert summary.median_step_time_s == pytest.approx(0.011)
    assert summary.phases["forward"] == pytest.approx(0.001)
    assert summary.phases["pushes"] == pytest.approx(0.001)
    assert summary.phases["other"] == pytest.approx(0.009)


def test_compare_says_when_phases_the_rewrite_leaves_alone_moved(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A new user's baseline ran its backward and all-reduce twice as slowly as the optimized
    run (a loaded host): compare says so beside the gain, and not when those phases agree."""
    base_phases = {"data": 0.0, "forward": 0.030, "waits": 0.020, "backward": 0.022}
    base_phases |= {"all_reduce": 0.015, "pushes": 0.001, "optimizer": 0.001}
    opt_phases = {**base_phases, "forward": 0.012, "waits": 0.004, "backward": 0.011}
    base = _phased_run(tmp_path, "base", "baseline", base_phases)
    slow = _phased_run(tmp_path, "slow", "optimized", opt_phases)
    same = _phased_run(tmp_path, "same", "optimized", {**opt_phases, "backward": 0.021})
    result = compare_runs([load_run(base), load_run(slow), load_run(same)], warmup=3)
    moved, agreed = result.gains
    assert moved.unchanged_s is not None
    assert moved.unchanged_s[0] == pytest.approx(0.024, rel=0.03)
    assert moved.unchanged_s[1] == pytest.approx(0.013, rel=0.03)
    assert moved.unchanged_differ and not agreed.unchanged_differ
    assert result.to_json()["runs"][1]["unchanged_phases_s"] == list(moved.unchanged_s)
    assert main(["compare", str(base), str(slow), str(same)]) == 0
    out = capsys.readouterr().out
    assert out.count("the phases the rewrite does not change") == 1
    assert (
        "slow: the phases the rewrite does not change (data, backward, pushes, optimizer)"
        in " ".join(out.split())
    )


def test_compare_prints_and_asserts_the_prediction_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    phases = {"data": 0.0, "forward": 0.030, "waits": 0.020, "backward": 0.004}
    phases |= {"all_reduce": 0.0, "pushes": 0.001, "optimizer": 0.001}
    base = _phased_run(tmp_path, "base", "baseline", phases)
    fast = {**phases, "forward": 0.012, "waits": 0.002}  # 36 ms -> 18 ms: 2x
    good = _phased_run(tmp_path, "good", "optimized", fast, predicted_gain=2.1)
    bad = _phased_run(tmp_path, "bad", "optimized", fast, predicted_gain=3.0)
    result = compare_runs([load_run(base), load_run(good), load_run(bad)], warmup=3)
    assert result.gains[0].prediction_error == pytest.approx(2.1 / result.gains[0].median - 1)
    assert [g.label for g in mispredicted(result, 0.15)] == [str(bad)]
    assert main(["compare", str(base), str(good), "--assert-prediction", "0.15"]) == 0
    out = capsys.readouterr().out
    assert "good: predicted gain 2.100× vs measured 2.0" in out
    assert main(["compare", str(base), str(good), str(bad), "--assert-prediction", "0.15"]) == 1
    err = capsys.readouterr().err
    assert err.startswith(
        f"distopt compare: assertion failed: the predicted gain of {bad} is off by +"
    )
    assert err.rstrip().endswith("beyond --assert-prediction 0.15")
    # A run without a prediction has nothing to trust.
    plain = _phased_run(tmp_path, "plain", "optimized", fast)
    assert main(["compare", str(base), str(plain), "--assert-prediction", "0.15"]) == 1
    assert "has no prediction" in capsys.readouterr().err


def test_interval_resamples_blocks_of_steps(write_run: WriteRun) -> None:
    # Drift within each run: consecutive steps are alike, so single steps understate the spread.
    base_qps = 1000 * (1 + 0.1 * np.sin(np.arange(200) / 10))
    fast_qps = 1100 * (1 + 0.1 * np.sin(np.arange(200) / 10 + 2))
    one = bootstrap_ratio_of_medians(base_qps, fast_qps, block=1)
    blocks = bootstrap_ratio_of_medians(base_qps, fast_qps, block=20)
    assert one[0] == blocks[0]  # the same point estimate
    assert blocks[2] - blocks[1] > 1.5 * (one[2] - one[1])
    with pytest.raises(CompareError, match="--block: expected an integer >= 1, got 0"):
        bootstrap_ratio_of_medians(base_qps, fast_qps, block=0)
    result = compare_runs(
        [load_run(write_run("b", 1000.0)), load_run(write_run("f", 1100.0))], block=7
    )
    assert "blocks of 7 consecutive steps" in result.interval
    assert result.to_json()["interval"] == result.interval


def test_jobs_of_one_variant_are_pooled(write_run: WriteRun) -> None:
    # The host slowed down between the jobs: base0, fast0 ran fast; fast1, base1 slow (ABBA).
    base = [load_run(write_run("b0", 1000.0, seed=1)), load_run(write_run("b1", 800.0, seed=2))]
    fast = [
        load_run(write_run(name, qps, variant="optimized", seed=seed))
        for name, qps, seed in (("f0", 1100.0, 3), ("f1", 880.0, 4))
    ]
    result = compare_runs([base, fast], labels=["b", "f"])
    (gain,) = result.gains
    assert result.runs[0].jobs == 2 and result.runs[0].steps == 2 * (200 - 5)
    assert gain.ci_low < 1.10 < gain.ci_high
    assert gain.rounds == pytest.approx((1.10, 1.10), rel=0.02)
    assert "t interval over 2 rounds" in result.interval
    # Unequal job counts: no rounds to pair, the two-stage bootstrap.
    uneven = compare_runs([base, fast[:1]], labels=["b", "f"])
    assert not uneven.gains[0].rounds
    assert "steps pooled from alternated jobs (2 baseline, 1 optimized)" in uneven.interval
    # One job of each, from opposite ends of the drift, gives a confident wrong answer.
    lone = compare_runs([base[0], fast[1]], labels=["b", "f"]).gains[0]
    assert lone.ci_high < 1.0
    mixed = [base[0], load_run(write_run("other", 900.0, config={"lr": 0.5}))]
    with pytest.raises(CompareError, match=r"lr \(use --force"):
        compare_runs([mixed, fast], labels=["b", "f"])


def test_the_predicted_gain_of_several_jobs_is_their_geometric_mean(write_run: WriteRun) -> None:
    """As the measured gain is of their rounds: one job's prediction alone moved between runs."""
    base = [load_run(write_run(f"b{i}", 1000.0, seed=i)) for i in range(2)]
    fast = [
        load_run(write_run(f"f{i}", 1600.0, variant="optimized", seed=5 + i, extra=extra))
        for i, extra in enumerate(({"predicted_gain": 1.6}, {"predicted_gain": 1.8}))
    ]
    (gain,) = compare_runs([base, fast], labels=["b", "f"]).gains
    assert gain.predicted == pytest.approx((1.6 * 1.8) ** 0.5)
    # A job without a prediction leaves the others' to say it.
    fast[1] = load_run(write_run("f2", 1600.0, variant="optimized", seed=7))
    assert compare_runs([base, fast], labels=["b", "f"]).gains[0].predicted == 1.6


def test_an_interval_over_jobs_holds_their_spread() -> None:
    """Two jobs per variant whose gains differ (1.08× and 1.12×, each tight within its steps):
    the two-stage interval holds both jobs' gains; resampling the pooled steps alone gives a
    confident interval around 1.10× that holds neither."""
    rng = np.random.default_rng(3)
    base = [rng.normal(1000, 10, 150), rng.normal(1000, 10, 150)]
    cand = [rng.normal(1080, 11, 150), rng.normal(1120, 11, 150)]
    point, low, high = bootstrap_ratio_of_medians(base, cand, block=10)
    assert low < 1.085 and high > 1.115 and low < point < high
    _, steps_low, steps_high = bootstrap_ratio_of_medians(
        np.concatenate(base), np.concatenate(cand), block=10
    )
    assert 1.08 < steps_low < steps_high < 1.12


def test_an_interval_over_rounds_holds_the_spread_between_rounds() -> None:
    """Four rounds whose gains spread (1.05× to 1.20×) while every job is tight within its steps:
    the interval over rounds holds every round's gain and the pooled ratio; a bootstrap of the
    pooled steps is confident about a value that two rounds miss. Two rounds give one degree of
    freedom: a wide interval, which a third round narrows."""
    rng = np.random.default_rng(5)
    gains = (1.05, 1.20, 1.10, 1.15)
    base = [rng.normal(1000, 10, 120) for _ in gains]
    cand = [rng.normal(1000 * g, 10, 120) for g in gains]
    four = rounds_interval(base, cand)
    point, low, high, rounds = four.gain, four.ci_low, four.ci_high, four.rounds
    assert rounds == pytest.approx(gains, rel=0.01)
    assert low < 1.05 and high > 1.20 and low < point < high
    assert point == pytest.approx(np.exp(np.mean(np.log(rounds))))
    assert (four.earlier_runs, four.degrees_of_freedom, four.between_runs) == (0, 3, False)
    _, steps_low, steps_high = bootstrap_ratio_of_medians(
        np.concatenate(base), np.concatenate(cand), block=10
    )
    assert steps_high - steps_low < 0.5 * (high - low)
    two = rounds_interval(base[:2], cand[:2])
    three = rounds_interval(base[:3], cand[:3])
    assert two.ci_high - two.ci_low > three.ci_high - three.ci_low
    with pytest.raises(CompareError, match="rounds need two or more jobs on each side"):
        rounds_interval(base[:1], cand[:1])
    with pytest.raises(CompareError, match="got 2 and 3"):
        rounds_interval(base[:2], cand[:3])


def _optimized_log(out: Path, run_id: str, config: dict[str, Any]) -> QpsLogWriter:
    """The QPS log of rank 0 of a one-trainer optimized run."""
    return QpsLogWriter.create(
        out,
        run_id=run_id,
        variant="optimized",
        rank=0,
        world_size=1,
        global_batch_size=64,
        config={**config, "run_id": run_id},
    )


def _fetching_run(out: Path, run_id: str, rows: int, **cache: float) -> Path:
    """A run whose steps record fetch counts (and, given ``cache``, row-cache fields)."""
    with _optimized_log(out, run_id, {"model": "dlrm"}) as writer:
        for step in range(20):
            writer.log_step(
                step,
                0.01,
                rows_fetched=rows + step % 3,
                bytes_fetched=(rows + step % 3) * 64,
                **cache,
            )
    return out / run_id


def test_fetches_and_row_caches_are_summarized_per_run(tmp_path: Path) -> None:
    from rich.console import Console

    from distopt.cli.cmd_compare import render

    plain = load_run(_fetching_run(tmp_path, "plain", 1000))
    cached = load_run(
        _fetching_run(
            tmp_path, "cached", 300, cache_hit_rate=0.7, cache_bytes=2 << 20, cache_staleness_max=1
        )
    )
    result = compare_runs([plain, cached], labels=["plain", "cached"], warmup=2)
    assert result.runs[0].fetches == {"rows_fetched": 1001.0, "bytes_fetched": 1001.0 * 64}
    assert result.runs[1].fetches == {
        "rows_fetched": 301.0,
        "bytes_fetched": 301.0 * 64,
        "cache_hit_rate": 0.7,
        "cache_bytes": float(2 << 20),
        "cache_staleness_max": 1.0,
    }
    assert result.to_json()["runs"][1]["fetches"]["cache_hit_rate"] == 0.7
    console = Console(record=True, width=160)
    render(result, console)
    text = console.export_text()
    assert "parameter-server fetches per trainer step" in text
    assert "70.0%" in text and "2.00" in text


def _failed_run(out: Path, run_id: str, *, steps: int, planned: int) -> Path:
    """A run whose trainer raised after ``steps`` steps: the real writer's footer says so."""
    config = {**CONFIG, "steps": planned, "variant": "optimized"}
    with pytest.raises(RuntimeError), _optimized_log(out, run_id, config) as writer:
        for step in range(steps):
            writer.log_step(step, 0.05)
        raise RuntimeError("LookupError: catalog shard unavailable\n(the traceback's rest)")
    return out / run_id


def test_a_run_that_did_not_finish_is_refused_unless_forced(
    tmp_path: Path, write_run: WriteRun, capsys: pytest.CaptureFixture[str]
) -> None:
    """A user's trial: a job that failed at step 39 of 60 was compared as a normal run."""
    base = write_run("base", 1000.0, steps=60, config={"steps": 60})
    died = _failed_run(tmp_path, "died", steps=39, planned=60)
    with pytest.raises(CompareError) as info:
        compare_runs([load_run(base), load_run(died)])
    assert str(info.value) == (
        f"{died}: rank 0 failed after 39 of 60 steps (RuntimeError: LookupError: catalog shard "
        "unavailable): its QPS is of part of a run (use --force to compare anyway)"
    )
    assert main(["compare", str(base), str(died)]) == 2
    assert "its QPS is of part of a run" in capsys.readouterr().err
    forced = compare_runs([load_run(base), load_run(died)], force=True)
    assert forced.unfinished == (str(info.value).split(": its QPS")[0],)
    assert main(["compare", str(base), str(died), "--force"]) == 0
    assert (
        f"--force: did not finish: {died}: rank 0 failed after 39 of 60" in capsys.readouterr().out
    )


def test_the_predicted_phases_of_several_jobs_are_their_mean(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Each job predicts its own phases: the report puts their mean beside the measured medians
    of all the jobs (it showed the first job's), and prints the pooled jobs in brace form."""
    measured = {"data": 0.0, "forward": 0.010, "waits": 0.008, "backward": 0.002}
    measured |= {"all_reduce": 0.0, "pushes": 0.003, "optimizer": 0.001}
    base = [_phased_run(tmp_path, f"demo-baseline-{i}", "baseline", measured) for i in range(2)]
    opt = [
        _phased_run(
            tmp_path,
            f"demo-optimized-{i}",
            "optimized",
            measured,
            predicted_phases={
                "baseline": {**measured, "forward": forward + 0.01},
                "optimized": {**measured, "forward": forward},
            },
            predicted_gain=gain,
            predicted_step_time_s=0.001 * (i + 1),
        )
        for i, (forward, gain) in enumerate(((0.010, 1.5), (0.014, 1.3)))
    ]
    result = compare_runs([[load_run(p) for p in base], [load_run(p) for p in opt]], warmup=3)
    rows = {row.phase: row for row in result.phases}
    assert rows["forward"].predicted == pytest.approx(0.012)
    assert rows["forward"].baseline_predicted == pytest.approx(0.022)
    assert rows["pushes"].predicted == pytest.approx(0.003)
    assert rows["step"].predicted == pytest.approx(0.012 + 0.002 + 0.003 + 0.001)
    assert result.runs[1].predicted_step_time_s == pytest.approx(0.0015)
    labels = [",".join(str(p) for p in run) for run in (base, opt)]
    assert main(["compare", *labels, "--warmup", "3"]) == 0
    out = capsys.readouterr().out
    assert "demo-optimized-{0,1}" in out
    assert "demo-optimized-0,demo-optimized-1" not in out


def test_a_phase_missing_from_one_jobs_header_is_averaged_over_the_others(tmp_path: Path) -> None:
    """As a job without a predicted gain is left out of the jobs' gain, not counted as 1."""
    measured = {"data": 0.0, "forward": 0.010, "backward": 0.002, "pushes": 0.003}
    older = {"baseline": dict(measured), "optimized": dict(measured)}
    newer = {name: {**phases, "other": 0.002} for name, phases in older.items()}
    runs = [
        load_run(_phased_run(tmp_path, f"o{i}", "optimized", measured, predicted_phases=header))
        for i, header in enumerate((older, newer))
    ]
    summary = summarize(runs, label="o", warmup=3)
    assert summary.predicted_phases is not None
    assert summary.predicted_phases["optimized"]["other"] == pytest.approx(0.002)
    assert summary.predicted_phases["optimized"]["forward"] == pytest.approx(0.010)


def test_pooled_labels_print_in_brace_form() -> None:
    assert shown_label("/r/demo-b-0,/r/demo-b-1") == "/r/demo-b-{0,1}"
    assert shown_label("/r/demo-b-0,/r/demo-b-1", short=True) == "demo-b-{0,1}"
    assert shown_label("/r/one-run") == "/r/one-run"
    assert shown_label("/r/one-run", short=True) == "one-run"


def test_the_plot_draws_each_pooled_job_as_its_own_line() -> None:
    """Two jobs of steps 0–2: a gap between them, not a line from step 2 back to step 0."""
    xs, ys = jobs_apart((0, 1, 2, 0, 1, 2), (1.0, 2.0, 3.0, 4.0, 5.0, 6.0))
    assert xs[:3] == [0, 1, 2] and xs[4:] == [0, 1, 2] and math.isnan(xs[3])
    assert ys[:3] == [1.0, 2.0, 3.0] and ys[4:] == [4.0, 5.0, 6.0] and math.isnan(ys[3])
    assert jobs_apart((0, 1, 2), (1.0, 2.0, 3.0)) == ([0, 1, 2], [1.0, 2.0, 3.0])


def _rounds_of(gains: Sequence[float], seed: int) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Paired jobs whose rounds' gains are ``gains`` (each job tight within its steps)."""
    rng = np.random.default_rng(seed)
    base = [rng.normal(1000, 1, 120) for _ in gains]
    return base, [b * g for b, g in zip(base, gains, strict=True)]


def test_rounds_that_agree_by_chance_take_the_spread_of_earlier_runs_rounds() -> None:
    """The demo's two runs of 2026-11-30 00:31 and 00:33: each's rounds within ±2%, measured
    1.630× and 1.793×. Alone, the first's interval is ±1.6% and its repeat interval ends below
    the second's gain; with the second run's rounds as an earlier run's, its rounds' spread is
    pooled (6 degrees of freedom) and the interval widens by half (one earlier run cannot show
    the drift between runs: that takes four runs, the next test)."""
    first = (1.648, 1.638, 1.622, 1.612)
    second = (1.735, 1.843, 1.797, 1.799)
    alone = rounds_interval(*_rounds_of(first, 1))
    assert alone.gain == pytest.approx(1.630, abs=0.001)
    assert alone.ci_high < 1.66 and alone.repeat_high < 1.793
    pooled = rounds_interval(*_rounds_of(first, 1), earlier=[second])
    assert pooled.gain == alone.gain and pooled.rounds == alone.rounds
    assert (pooled.earlier_runs, pooled.degrees_of_freedom, pooled.between_runs) == (1, 6, False)
    assert pooled.ci_high - pooled.ci_low > 1.4 * (alone.ci_high - alone.ci_low)
    # The repeat interval is √2 as wide as the confidence interval on the log scale.
    assert np.log(pooled.repeat_high / pooled.gain) == pytest.approx(
        np.sqrt(2) * np.log(pooled.ci_high / pooled.gain)
    )
    spread, dof = pooled_spread([np.log(alone.rounds), np.log(second)])
    assert dof == 6
    assert np.log(pooled.ci_high / pooled.gain) == pytest.approx(
        scipy.stats.t.ppf(0.975, 6) * spread / 2
    )


def test_runs_whose_gains_spread_more_than_their_rounds_weigh_the_runs_gains() -> None:
    """Four runs, rounds within ±0.5% of each run's gain, the runs' gains 1.63–1.80×: from four
    runs on, a run's gain has a between-run part of variance (one-way random effects; 3 degrees
    of freedom), and the last run's repeat interval holds every run's gain."""
    runs = [(1.632, 1.628, 1.631, 1.629), (1.801, 1.795, 1.799, 1.805), (1.70, 1.71, 1.69, 1.70)]
    last = (1.662, 1.658, 1.660, 1.660)
    result = rounds_interval(*_rounds_of(last, 2), earlier=runs)
    assert result.between_runs and result.degrees_of_freedom == 3 and result.earlier_runs == 3
    logs = [np.log(r) for r in (*runs, last)]
    means = [float(np.exp(np.mean(r))) for r in logs]
    assert all(result.repeat_low < m < result.repeat_high for m in means)
    # Equal rounds: the variance of a run's gain is the runs' means' variance.
    half = np.log(result.ci_high / result.gain)
    assert half == pytest.approx(
        scipy.stats.t.ppf(0.975, 3) * np.std([r.mean() for r in logs], ddof=1), rel=1e-6
    )
    # Three runs are too few to weigh their gains: the rounds' spread alone, pooled.
    fewer = rounds_interval(*_rounds_of(last, 2), earlier=runs[:2])
    assert not fewer.between_runs and fewer.degrees_of_freedom == 9


def test_runs_whose_gains_agree_within_their_rounds_noise_keep_the_pooled_spread() -> None:
    """Four runs whose gains differ by less than their rounds' noise explains: no between-run
    part, and the rounds' pooled spread keeps all its degrees of freedom (12)."""
    runs = [(1.60, 1.75, 1.68, 1.72), (1.74, 1.62, 1.70, 1.66), (1.65, 1.71, 1.77, 1.63)]
    last = (1.70, 1.64, 1.73, 1.67)
    result = rounds_interval(*_rounds_of(last, 4), earlier=runs)
    assert not result.between_runs and result.degrees_of_freedom == 12
    spread, _ = pooled_spread([np.log(result.rounds), *(np.log(r) for r in runs)])
    assert np.log(result.ci_high / result.gain) == pytest.approx(
        scipy.stats.t.ppf(0.975, 12) * spread / 2, rel=1e-6
    )


@given(
    runs=st.lists(st.lists(st.floats(-1, 1), min_size=2, max_size=6), min_size=1, max_size=5),
    shifts=st.lists(st.floats(-2, 2), min_size=5, max_size=5),
)
def test_the_pooled_spread_is_about_each_runs_own_mean(
    runs: list[list[float]], shifts: list[float]
) -> None:
    """The pooled spread is the rounds' squared deviations from their own run's mean over the
    rounds less one per run (runs of unequal lengths weighed by their degrees of freedom): a
    run's own gain does not enter, so shifting every round of a run by one log-factor leaves it
    as it was."""
    spread, dof = pooled_spread(runs)
    squares = sum(float(((np.asarray(r) - np.mean(r)) ** 2).sum()) for r in runs)
    assert dof == sum(len(r) - 1 for r in runs)
    assert spread == pytest.approx(np.sqrt(squares / dof), abs=1e-12)
    shifted = [[x + shift for x in run] for run, shift in zip(runs, shifts, strict=False)]
    assert pooled_spread(shifted) == (pytest.approx(spread, abs=1e-9), dof)
    if len(runs) == 1:
        assert spread == pytest.approx(float(np.std(runs[0], ddof=1)), abs=1e-12)


@pytest.mark.parametrize(
    ("earlier", "message"),
    [
        ([[1.5]], "earlier rounds 1.5: a run needs two or more rounds"),
        ([[1.5, -1.0]], "earlier rounds 1.5,-1: gains must be positive numbers"),
        ([[1.5, float("nan")]], "earlier rounds 1.5,nan: gains must be positive numbers"),
    ],
)
def test_bad_earlier_rounds_are_one_line_errors(earlier: list[list[float]], message: str) -> None:
    base, cand = _rounds_of((1.1, 1.2), 3)
    with pytest.raises(CompareError, match=f"^{re.escape(message)}$"):
        rounds_interval(base, cand, earlier=earlier)


def test_earlier_rounds_belong_to_one_comparison(write_run: WriteRun) -> None:
    base = [load_run(write_run(f"b{i}", 1000.0, seed=i)) for i in range(2)]
    opts = [
        [
            load_run(write_run(f"{name}{i}", 1500.0, variant="optimized", seed=9 + i))
            for i in range(2)
        ]
        for name in ("o", "p")
    ]
    with pytest.raises(
        CompareError,
        match=r"^earlier rounds: only with one run beside the baseline \(they are the rounds of "
        r"that comparison\), got 2$",
    ):
        compare_runs([base, *opts], earlier_rounds=[(1.4, 1.6)])


def test_compare_says_how_the_earlier_runs_weighed_in(write_run: WriteRun) -> None:
    base = [load_run(write_run(f"b{i}", 1000.0, seed=10 + i)) for i in range(4)]
    opt = [
        load_run(write_run(f"o{i}", g, variant="optimized", seed=20 + i))
        for i, g in enumerate((1500.0, 1520.0, 1490.0, 1510.0))
    ]
    result = compare_runs([base, opt], earlier_rounds=[(1.4, 1.6, 1.5, 1.45)])
    (gain,) = result.gains
    assert gain.over_rounds is not None and gain.over_rounds.earlier_runs == 1
    assert (
        "their spread pooled with that of the rounds of 1 earlier run (6 degrees" in result.interval
    )
    row = result.to_json()["runs"][1]
    assert row["earlier_runs"] == 1
    assert (row["degrees_of_freedom"], row["between_runs"]) == (6, False)
    assert row["repeat_low"] < row["gain_ci_low"] < row["gain"] < row["gain_ci_high"]
    assert row["gain_ci_high"] < row["repeat_high"]
