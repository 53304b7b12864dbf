"""``distopt demo``: bad input fails before any job starts (the wheel run is tests/test_packaging.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from distopt.cli import main


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--config", "nope.yaml"], "--config: config file not found: nope.yaml"),
        (["--config", "configs/jobs/nope.yaml"],
         "--config: config file not found: configs/jobs/nope.yaml"),
        (["--steps", "0"], "--steps: expected an integer >= 1, got 0"),
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


@pytest.mark.slow
def test_the_demo_learns_the_click_log_the_same_in_both_variants(tmp_path: Path) -> None:
    """``distopt demo`` trains on data with a signal: it prints a held-out AUC well above 0.5
    (about 0.83 after the default 150 steps; the file's best is about 0.89), the same for both
    variants (deterministic jobs), before the compare table."""
    import re

    from tests import shell

    proc = shell.run(
        "distopt", "demo", "--steps", "60", "--out", tmp_path, cwd=tmp_path, timeout=900
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    learned = dict(
        re.findall(
            r"^(baseline|optimized): held-out (auc [\d.]+, loss [\d.]+) after 60 steps",
            proc.stdout,
            re.M,
        )
    )
    assert learned["baseline"] == learned["optimized"], learned
    auc = float(learned["baseline"].split(",")[0].split()[1])
    assert auc > 0.75, learned
    assert "gain [95% CI]" in proc.stdout and (tmp_path / "clicks.tsv").is_file()
