"""A row cache as a user reaches it: ``--set ps.cache=...`` on a job of their own package
(``ps_stream``: an Adagrad and an SGD table read through ``RemoteEmbedding``), launched from a
copy outside the repository with ``distopt launch``; and its mistakes, refused in one line
before anything is scheduled."""

from __future__ import annotations

from pathlib import Path

import pytest

from distopt.metrics import load_run
from tests.pipeline.conftest import bitwise_equal
from tests.supervised import final_state
from tests.user_jobs.as_user import copy_out, distopt_cli, launch, losses, replica_logs

STEPS = 40
CACHE = "ps.cache={ads: {capacity_rows: 1500, policy: lfu}, queries: {capacity_bytes: 20000}}"


@pytest.mark.slow
def test_an_exact_cache_trains_bitwise_as_without_one(tmp_path: Path) -> None:
    """Two trainers, ``deterministic: true`` (the job's own setting): the same losses on every
    trainer, the same dense parameters and optimizer state, the same tables and Adagrad state."""
    work = copy_out("ps_stream", tmp_path)
    sets = (f"checkpoint_every={STEPS}", "tensorboard=false")
    launch(work, "baseline", ps=True, run_id="plain", sets=sets)
    launch(work, "baseline", ps=True, run_id="cached", sets=(*sets, CACHE))
    plain, cached = load_run(work / "runs" / "plain"), load_run(work / "runs" / "cached")
    assert losses(plain) == losses(cached)
    assert all(len(loss) == STEPS for loss in losses(cached).values())
    runs = work / "runs"
    assert bitwise_equal(final_state(runs / "plain", STEPS), final_state(runs / "cached", STEPS))
    for rank, log in cached.ranks.items():
        rows = sum(s.rows_fetched or 0 for s in log.steps)
        assert rows < sum(s.rows_fetched or 0 for s in plain.ranks[rank].steps)
        assert max(s.cache_hit_rate or 0 for s in log.steps) > 0
        assert {s.cache_staleness_max for s in log.steps} == {0}
    for name, text in replica_logs(work, "cached").items():
        assert "Traceback" not in text, (name, text)


def _refused(work: Path, *sets: str) -> str:
    """``distopt launch job.yaml --dryrun --set ...``: the one line of its refusal."""
    args = ["launch", "job.yaml", "--dryrun"]
    for item in sets:
        args += ["--set", item]
    proc = distopt_cli(*args, cwd=work, timeout=120)
    assert proc.returncode != 0, proc.stdout[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    return lines[0]


def test_cache_mistakes_are_one_line_errors_before_anything_runs(tmp_path: Path) -> None:
    work = copy_out("ps_stream", tmp_path)
    model = work / "ctrstream" / "model.py"  # declare a third table the forward never fetches
    model.write_text(
        model.read_text().replace(
            'TableSpec(name="queries", num_rows=N_QUERIES, dim=DIM)]',
            'TableSpec(name="queries", num_rows=N_QUERIES, dim=DIM),\n'
            '                TableSpec(name="unused", num_rows=10, dim=DIM)]',
        )
    )
    assert "unused" in model.read_text()
    assert _refused(work, "ps.cache={ads: {capacity_rows: -1}}") == (
        "distopt launch: error: ps.cache.ads.capacity_rows: expected an integer >= 1, or null, "
        "got -1"
    )
    assert _refused(work, "ps.cache={unused: {capacity_rows: 5}}") == (
        "distopt launch: error: ps.cache.unused: the model does not read table 'unused' "
        "(its forward fetches: ads, queries)"
    )
    assert _refused(work, "ps.cache={clicks: {capacity_rows: 5}}") == (
        "distopt launch: error: ps.cache.clicks: the model has no table 'clicks' "
        "(its tables: ads, queries, unused)"
    )
    line = _refused(work, "ps.cache={ads: {capacity_bytes: 1000000000000000}}")
    assert line.startswith(
        "distopt launch: error: ps.cache.ads.capacity_bytes: 1000000000000000 takes 931322.6 GiB, "
        "more than the "
    ) and line.endswith(" of memory available on this host"), line
    assert not (work / "runs").exists() or not any((work / "runs").rglob("qps-rank*.jsonl"))
