"""Capture coverage over third-party models: every returned model must be correct."""

import pytest

from distopt.cli import main
from distopt.coverage import check_model, corpus

ENTRIES = corpus()


@pytest.mark.slow
@pytest.mark.parametrize("entry", ENTRIES, ids=[e.name for e in ENTRIES])
def test_no_silently_wrong_model(entry) -> None:
    if not entry.available:
        pytest.fail(f"{entry.library} is not installed (it is in the dev extra)")
    row = check_model(entry)
    assert row.outcome in ("verified", "fallback"), row
    # Every corpus model is captured by some graph tier today; a regression to fallback shows here.
    assert row.tier in ("symbolic_trace", "dynamo"), row


def test_coverage_cli_runs_one_entry_and_writes_json(tmp_path, capsys) -> None:
    out = tmp_path / "rows.json"
    assert main(["coverage", "--only", "nfm", "--json", str(out)]) == 0
    assert '"outcome": "verified"' in out.read_text()


def test_unknown_entry_is_rejected(capsys) -> None:
    assert main(["coverage", "--only", "nope"]) == 2
    assert "unknown corpus entry 'nope'" in capsys.readouterr().err
