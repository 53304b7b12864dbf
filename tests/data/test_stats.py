"""``distopt data stats``: the skew of a Criteo-format file's ids, as a user asks for it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from distopt.data.criteo import TableLayout
from distopt.data.generate import write_criteo
from distopt.data.stats import criteo_id_stats

DISTOPT = str(Path(sys.executable).with_name("distopt"))


@pytest.fixture(scope="module")
def zipf_clicks(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Every categorical feature: 5000 values drawn Zipf(1.05), 5% missing."""
    path = tmp_path_factory.mktemp("stats") / "clicks.tsv"
    return write_criteo(path, num_samples=40_000, seed=2, vocab_sizes=(5000,), alpha=1.05)


def test_alpha_of_every_feature_is_the_generated_one(zipf_clicks: Path) -> None:
    features, tables = criteo_id_stats(zipf_clicks)
    assert [f.name for f in features] == [f"C{j}" for j in range(1, 27)] and tables == []
    for feature in features:
        assert feature.alpha == pytest.approx(1.05, abs=0.04), feature
        assert feature.missing == pytest.approx(0.05, abs=0.01)
        assert feature.accesses == round(40_000 * (1 - feature.missing))
        assert 3000 < feature.distinct <= 5000


def test_the_readers_hash_keeps_the_skew_of_each_feature(zipf_clicks: Path) -> None:
    # One feature per table, far more rows than values: the hash maps values to rows one to
    # one but for rare collisions (about d² / 2N = 7 of d = 3,800 values on N = 1M rows), so
    # each table's counts are its feature's, plus its missing values, which the reader maps to
    # one row of their own.
    layout = TableLayout(num_tables=26, num_rows=1_000_000)
    features, tables = criteo_id_stats(zipf_clicks, layout=layout, cache_fraction=0.02)
    for feature, table in zip(features, tables, strict=True):
        assert table.accesses == 40_000
        assert feature.distinct - 25 <= table.distinct <= feature.distinct + 1
        assert table.alpha == pytest.approx(feature.alpha, abs=0.03)
        assert table.top_share >= feature.top_share - 0.01


def test_data_stats_command_prints_alpha_per_feature_and_table(zipf_clicks: Path) -> None:
    done = subprocess.run(
        [DISTOPT, "data", "stats", str(zipf_clicks), "--num-tables", "2", "--num-rows", "100000"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0 and done.stderr == "", done.stderr
    lines = done.stdout.splitlines()
    assert any("C26" in line and "1.0" in line for line in lines), done.stdout
    assert any("table 1" in line for line in lines), done.stdout
    assert "α (MLE)" in done.stdout and "top 2% share" in done.stdout


def test_data_stats_of_a_bad_file_is_one_line(tmp_path: Path) -> None:
    bad = tmp_path / "bad.tsv"
    bad.write_text("1\t2\n")
    done = subprocess.run(
        [DISTOPT, "data", "stats", str(bad)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr == (
        f"distopt data: error: FILE: {bad}:1: expected 40 tab-separated fields, got 2\n"
    )
