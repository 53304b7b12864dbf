"""``distopt bench CONFIG --set ...``: bad overrides are one-line errors naming the key."""

from __future__ import annotations

from pathlib import Path

import pytest

from distopt.cli import main

CONFIG = str(Path(__file__).resolve().parents[2] / "configs" / "bench" / "optimize_overhead.yaml")
KNOWN = "node_counts, repeats, target_s_per_1k, verify, width"


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("repets=1", f"repets: unknown key (known keys: {KNOWN})"),
        ("repeats=abc", "repeats: expected an integer, got 'abc'"),
        ("node_counts=[1,2", "node_counts: cannot parse '[1,2' as YAML "
                             "(expected ',' or ']', but got '<stream end>')"),
    ],
)  # fmt: skip
def test_bad_override_is_one_line(
    override: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["bench", CONFIG, "--set", override]) == 2
    assert capsys.readouterr().err == f"distopt bench: error: {message}\n"
