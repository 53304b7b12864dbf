"""Row caches in a launched DLRM job on a Criteo-format file (2 trainers, 1 parameter server,
``deterministic: true``, the optimized model in an exact pipeline; the processes of
``python -m distopt.train`` started by ``distopt.roles.supervise``): ``exact`` is bitwise the
job without a cache, ``staleness: 1`` keeps the held-out AUC and logs its staleness."""

from __future__ import annotations

from pathlib import Path

import pytest

from distopt.data.generate import write_criteo
from tests.pipeline.conftest import bitwise_equal
from tests.supervised import final_state, records, supervise

pytestmark = pytest.mark.slow

STEPS = 80
TABLES = ("emb0", "emb1", "emb2", "emb3")


def _cache(consistency: str) -> str:
    """Half of each table's 2000 rows, with the given consistency."""
    extra = ", consistency: staleness, staleness: 1" if consistency == "stale" else ""
    return "{" + ", ".join(f"{t}: {{capacity_rows: 1000{extra}}}" for t in TABLES) + "}"


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same job three times: no cache, an exact cache, a cache with staleness 1."""
    root = tmp_path_factory.mktemp("cache_job")
    clicks = write_criteo(root / "clicks.tsv", num_samples=12_000, seed=0)
    for run_id, cache in [("plain", "{}"), ("exact", _cache("exact")), ("stale", _cache("stale"))]:
        sets = [
            f"data.path={clicks}",
            "variant=optimized",
            f"steps={STEPS}",
            "deterministic=true",
            "pipeline={enabled: true, staleness: 0}",
            "eval={every: 0, batch_size: 500}",
            f"output_dir={root}",
            f"run_id={run_id}",
            f"checkpoint_every={STEPS}",
            "tensorboard=false",
            f"ps.cache={cache}",
        ]
        done = supervise("configs/jobs/dlrm_criteo.yaml", sets)
        assert "Traceback" not in done.stderr, done.stderr[-3000:]
    return root


def test_exact_cache_ends_bitwise_equal_to_the_job_without_one(runs: Path) -> None:
    plain, exact = final_state(runs / "plain", STEPS), final_state(runs / "exact", STEPS)
    # Dense parameters and Adam state of the trainers, rows and row-wise Adagrad state of the server.
    assert bitwise_equal(plain["dense"], exact["dense"])
    assert bitwise_equal(plain["tables"], exact["tables"])
    for rank in (0, 1):
        plain_steps = records(runs / "plain", "step", rank)
        exact_steps = records(runs / "exact", "step", rank)
        assert [r["loss"] for r in plain_steps] == [r["loss"] for r in exact_steps]
        # Served from the cache, and so fewer rows sent, yet never a stale row.
        assert sum(r["rows_fetched"] for r in exact_steps) < sum(
            r["rows_fetched"] for r in plain_steps
        )
        # (The last step prefetches nothing: it looks no row up and logs no hit rate.)
        assert max(r.get("cache_hit_rate", 0) for r in exact_steps) > 0
        assert {r["cache_staleness_max"] for r in exact_steps} == {0}
        assert all(r["cache_bytes"] > 0 for r in exact_steps)
        assert all("cache_hit_rate" not in r for r in plain_steps)


def test_staleness_one_keeps_the_held_out_auc_and_logs_its_staleness(runs: Path) -> None:
    exact, stale = records(runs / "exact", "eval")[-1], records(runs / "stale", "eval")[-1]
    assert exact["step"] == stale["step"] == STEPS
    assert abs(stale["eval_auc"] - exact["eval_auc"]) <= 0.002, (exact, stale)
    for rank in (0, 1):
        steps = records(runs / "stale", "step", rank)
        assert max(r["cache_staleness_max"] for r in steps) == 1  # rows do miss one, never two
        exact_steps = records(runs / "exact", "step", rank)
        hits = sum(r.get("cache_hit_rate", 0) for r in steps)
        assert hits > sum(r.get("cache_hit_rate", 0) for r in exact_steps)
