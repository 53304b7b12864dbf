"""``distopt compare``: table, JSON, plot, config refusal, --assert-gain exit codes, bad input."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from distopt.cli import main
from tests.metrics.synthetic import write_synthetic_run


@pytest.fixture
def runs(tmp_path: Path) -> tuple[str, str]:
    base = write_synthetic_run(tmp_path, "base", 1000.0, seed=1)
    fast = write_synthetic_run(
        tmp_path, "fast", 1100.0, variant="optimized", seed=2, extra={"predicted_gain": 1.12}
    )
    return str(base), str(fast)


def test_table_json_and_plot(
    runs: tuple[str, str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    base, fast = runs
    out_json, out_png = tmp_path / "r.json", tmp_path / "plots" / "qps.png"
    assert main(["compare", base, fast, "--json", str(out_json), "--plot", str(out_png)]) == 0
    out = capsys.readouterr().out
    assert "median QPS" in out and "gain [95% CI]" in out
    assert "baseline" in out and "optimized" in out and "1.120×" in out
    data = json.loads(out_json.read_text())
    assert data["baseline"] == base and data["ci_level"] == 0.95 and data["warmup"] == 5
    first, second = data["runs"]
    assert first["gain"] is None and first["steps"] == 195
    assert second["gain_ci_low"] < 1.10 < second["gain_ci_high"]
    assert second["predicted_gain"] == 1.12
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out_png.stat().st_size > 10_000


def test_assert_gain_exit_codes(runs: tuple[str, str], capsys: pytest.CaptureFixture[str]) -> None:
    base, fast = runs
    assert main(["compare", base, fast, "--assert-gain", "1.02"]) == 0
    assert main(["compare", base, fast, "--assert-gain", "1.3"]) == 1
    err = capsys.readouterr().err
    assert "assertion failed: gain ci_low of" in err and "below --assert-gain 1.3" in err
    assert main(["compare", base, fast, "--assert-gain", "1.3", "--assert-stat", "median"]) == 1


def test_refuses_different_configs_unless_forced(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    base = write_synthetic_run(tmp_path, "base", 1000.0)
    other = write_synthetic_run(tmp_path, "other", 1000.0, config={"batch_size": 128})
    assert main(["compare", str(base), str(other)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0
    assert "configs differ in more than the variant: batch_size" in err
    assert main(["compare", str(base), str(other), "--force"]) == 0
    assert "configs differ in" in capsys.readouterr().out


def test_missing_run_and_empty_log_are_one_line_errors(
    runs: tuple[str, str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    base, _ = runs
    assert main(["compare", base, str(tmp_path / "missing")]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"distopt compare: error: run not found: {tmp_path / 'missing'}"
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "qps-rank0.jsonl").write_text("")
    assert main(["compare", base, str(empty)]) == 2
    assert "empty QPS log" in capsys.readouterr().err


def test_console_script_runs(runs: tuple[str, str]) -> None:
    """The installed entry point (a real process), as CI would call it."""
    base, fast = runs
    proc = subprocess.run(
        [sys.executable, "-m", "distopt", "compare", base, fast, "--assert-gain", "5"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 1, proc.stderr
    assert "gain [95% CI]" in proc.stdout


def _rounds(tmp_path: Path, gains: tuple[float, ...], stamp: str = "r") -> list[str]:
    """Alternated jobs of each variant (comma-joined, as ``distopt demo`` passes them)."""
    base = [
        write_synthetic_run(tmp_path, f"{stamp}-b{i}", 1000.0, seed=i) for i in range(len(gains))
    ]
    opt = [
        write_synthetic_run(tmp_path, f"{stamp}-o{i}", 1000.0 * g, variant="optimized", seed=9 + i)
        for i, g in enumerate(gains)
    ]
    return [",".join(map(str, base)), ",".join(map(str, opt))]


def test_earlier_rounds_widen_the_interval_and_print_a_repeat_interval(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    runs = _rounds(tmp_path, (1.64, 1.63, 1.62, 1.61))
    out_json = tmp_path / "r.json"
    assert main(["compare", *runs, "--json", str(out_json)]) == 0
    alone = json.loads(out_json.read_text())["runs"][1]
    out = " ".join(capsys.readouterr().out.split())
    assert "a repeat run of 4 rounds would measure [" in out
    assert "(95% repeat interval, rounds' noise alone)" in out
    assert "(from the rounds' noise alone: drift between runs enters from four runs on" in out
    earlier = ["--earlier-rounds", "1.735×, 1.843×, 1.797×, 1.799×", "--earlier-rounds", "1.7,1.6"]
    assert main(["compare", *runs, "--json", str(out_json), *earlier]) == 0
    out = " ".join(capsys.readouterr().out.split())  # as printed, less the console's wrapping
    pooled = json.loads(out_json.read_text())["runs"][1]
    assert pooled["earlier_runs"] == 2 and pooled["gain"] == alone["gain"]
    assert (
        pooled["gain_ci_high"] - pooled["gain_ci_low"]
        > alone["gain_ci_high"] - alone["gain_ci_low"]
    )
    assert "pooled with that of the rounds of 2 earlier runs (7 degrees of freedom in all)" in out


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("1.6,fast", "--earlier-rounds '1.6,fast': expected round gains separated by commas, "
                     "e.g. 1.648,1.638,1.622,1.612"),
        ("1.6", "earlier rounds 1.6: a run needs two or more rounds"),
        ("1.6,0", "earlier rounds 1.6,0: gains must be positive numbers"),
    ],
)  # fmt: skip
def test_bad_earlier_rounds_are_one_line_errors(
    value: str, message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    runs = _rounds(tmp_path, (1.5, 1.6))
    assert main(["compare", *runs, "--earlier-rounds", value]) == 2
    assert capsys.readouterr().err == f"distopt compare: error: {message}\n"


def test_earlier_rounds_need_a_gain_over_rounds(
    runs: tuple[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["compare", *runs, "--earlier-rounds", "1.5,1.6"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("distopt compare: error: --earlier-rounds: no gain here is over rounds")
    assert err.count("\n") == 1
