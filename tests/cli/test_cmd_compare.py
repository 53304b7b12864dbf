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
