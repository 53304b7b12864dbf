"""``distopt demo``: bad input fails before any job starts (the wheel run is tests/test_packaging.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from distopt.cli import cmd_demo, main
from distopt.cli.cmd_demo import MAX_STEPS_FACTOR, alternated, earlier_rounds, sized_steps
from tests.metrics.synthetic import write_synthetic_run


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--config", "nope.yaml"], "--config: config file not found: nope.yaml"),
        (["--config", "configs/jobs/nope.yaml"],
         "--config: config file not found: configs/jobs/nope.yaml"),
        (["--steps", "0"], "--steps: expected an integer >= 1, got 0"),
        (["--rounds", "0"], "--rounds: expected an integer >= 1, got 0"),
        (["--min-timed-s", "-1"], "--min-timed-s: expected seconds >= 0, got -1.0"),
        (["--assert-prediction", "-0.1"], "--assert-prediction: expected a fraction >= 0, got -0.1"),
    ],
)  # fmt: skip
def test_bad_input_is_one_line(
    args: list[str], message: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    monkeypatch.chdir(tmp_path)  # outside the checkout, like a user of the wheel
    assert main(["demo", "--out", str(tmp_path / "out"), *args]) == 2
    assert capsys.readouterr().err == f"distopt demo: error: {message}\n"
    assert not (tmp_path / "out").exists()


def test_rounds_alternate_which_variant_goes_first() -> None:
    assert alternated(1) == ["baseline", "optimized"]
    first, second = ["baseline", "optimized"], ["optimized", "baseline"]
    assert alternated(3) == first + second + first


def test_a_pilot_lengthens_jobs_whose_timed_steps_are_too_short() -> None:
    # 95 timed steps of 50 ms are 4.75 s: long enough.
    assert sized_steps(100, 5, 0.050, 4.0) == 100
    # 95 of 6 ms are 0.57 s: 667 timed steps make 4 s, plus the warm-up.
    assert sized_steps(100, 5, 0.006, 4.0) == 5 + 667
    # A step of microseconds lengthens the jobs by MAX_STEPS_FACTOR at most.
    assert sized_steps(100, 5, 1e-6, 4.0) == MAX_STEPS_FACTOR * 100


@pytest.mark.slow
def test_the_demo_learns_the_click_log_the_same_in_both_variants(tmp_path: Path) -> None:
    """``distopt demo`` trains on data with a signal: it prints a held-out AUC well above 0.5
    (about 0.83 after 150 steps; the file's best is about 0.89), the same for both
    variants (deterministic jobs), before the compare table."""
    import re

    from tests import shell

    proc = shell.run(
        "distopt",
        "demo",
        "--steps",
        "40",
        "--min-timed-s",
        "2.5",
        "--rounds",
        "2",
        "--out",
        tmp_path,
        cwd=tmp_path,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    # 35 timed steps of the demo's job take about 1.6 s here: a pilot sizes longer jobs.
    pilot = re.search(
        r"^pilot: 35 timed steps of ([\d.]+) ms \(median\) take ([\d.]+) s \(--min-timed-s 2.5\): "
        r"every job of the rounds runs (\d+) steps$",
        proc.stdout,
        re.M,
    )
    assert pilot, proc.stdout
    steps = int(pilot[3])
    assert steps == sized_steps(40, 5, float(pilot[1]) / 1e3, 2.5), pilot[0]
    found = re.findall(
        rf"^(baseline|optimized): held-out (auc [\d.]+, loss [\d.]+) after {steps} steps",
        proc.stdout,
        re.M,
    )
    # Two rounds, alternated; every job learns the same (deterministic jobs).
    assert [variant for variant, _ in found] == alternated(2), found
    assert len({result for _, result in found}) == 1, found
    learned = dict(found)
    auc = float(learned["baseline"].split(",")[0].split()[1])
    assert auc > 0.75, learned
    assert "gain [95% CI]" in proc.stdout and (tmp_path / "clicks.tsv").is_file()
    assert "95% t interval over 2 rounds" in proc.stdout
    assert re.search(
        r"rounds' gains [\d.]+×, [\d.]+×; a repeat run of 2 rounds would measure "
        r"\[[\d.]+, [\d.]+\] \(95% repeat interval, rounds' noise alone\)$",
        proc.stdout,
        re.M,
    ), proc.stdout
    phases = re.findall(r"^│ (\w+) +│", proc.stdout.split("step phases")[1], re.M)
    assert phases == [
        *("data", "forward", "waits", "backward", "all_reduce", "pushes", "optimizer"),
        *("other", "step"),
    ]


def _demo_run(out: Path, stamp: str, gains: tuple[float, ...], **options: Any) -> Path:
    """A demo run's jobs as ``distopt demo`` names them, written with the real QPS log writer."""
    for i, gain in enumerate(gains):
        write_synthetic_run(out, f"demo-{stamp}-baseline-{i}", 1000.0, seed=i, **options)
        write_synthetic_run(
            out, f"demo-{stamp}-optimized-{i}", 1000.0 * gain, variant="optimized", seed=50 + i,
            **options,
        )  # fmt: skip
    return out / f"demo-{stamp}-baseline-0"


def test_the_interval_weighs_earlier_runs_of_this_job_only(tmp_path: Path) -> None:
    """Earlier runs in ``--out`` of the same job (the steps a pilot chose aside), with two or more
    rounds, latest first; later runs, other jobs, single rounds and unreadable leftovers are
    passed over."""
    gains = (1.6, 1.7, 1.65, 1.75)
    _demo_run(tmp_path, "20261130-000100", gains)
    _demo_run(tmp_path, "20261130-000200", gains, config={"lr": 0.1})  # another job
    _demo_run(tmp_path, "20261130-000300", gains[:1])  # one round
    _demo_run(tmp_path, "20261130-000400", gains, config={"steps": 300})  # a pilot's steps
    broken = _demo_run(tmp_path, "20261130-000500", gains)
    (broken.parent / "demo-20261130-000500-optimized-2" / "qps-rank0.jsonl").write_text("")
    other_code = _demo_run(tmp_path, "20261130-000510", gains)
    _edit_header(other_code, git_revision="0" * 40)
    other_host = _demo_run(tmp_path, "20261130-000520", gains)
    _edit_header(other_host, host={"hostname": "elsewhere"})
    cut_short = _demo_run(tmp_path, "20261130-000530", gains)
    log = cut_short.parent / "demo-20261130-000530-optimized-3" / "qps-rank0.jsonl"
    log.write_text("".join(log.read_text().splitlines(keepends=True)[:-1]))  # no footer
    (tmp_path / "demo-junk-baseline-0").write_text("not a run")
    current = _demo_run(tmp_path, "20261130-000600", gains)
    _demo_run(tmp_path, "20261130-000700", gains)  # later
    found = earlier_rounds(tmp_path, "20261130-000600", current)
    assert [stamp for stamp, _ in found] == ["20261130-000400", "20261130-000100"]
    for _, rounds in found:
        assert rounds == pytest.approx(gains, rel=0.02)


def test_the_interval_weighs_the_latest_earlier_runs_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(cmd_demo, "EARLIER_RUNS", 2)
    for minute in range(1, 5):
        _demo_run(tmp_path, f"20261130-00{minute:02d}00", (1.5, 1.6))
    current = _demo_run(tmp_path, "20261130-001000", (1.5, 1.6))
    found = earlier_rounds(tmp_path, "20261130-001000", current)
    assert [stamp for stamp, _ in found] == ["20261130-000400", "20261130-000300"]


def _edit_header(job: Path, **values: Any) -> None:
    """Give rank 0's header of ``job`` other ``values`` (another commit, another host)."""
    log = job / "qps-rank0.jsonl"
    header, *rest = log.read_text().splitlines(keepends=True)
    log.write_text(json.dumps({**json.loads(header), **values}) + "\n" + "".join(rest))
