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
