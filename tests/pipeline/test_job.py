"""The pipeline in a launched DLRM job on a Criteo-format file (2 trainers, 1 parameter server, the
processes of ``python -m distopt.train`` started by ``distopt.roles.supervise``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from distopt.data.generate import write_criteo
from tests.pipeline.conftest import bitwise_equal
from tests.supervised import final_state, records, supervise

pytestmark = pytest.mark.slow

STEPS = 80


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same optimized job three times: no pipeline, exact pipeline, staleness 1."""
    root = tmp_path_factory.mktemp("pipeline_job")
    clicks = write_criteo(root / "clicks.tsv", num_samples=12_000, seed=0)
    for run_id, pipeline in [
        ("plain", "{enabled: false}"),
        ("exact", "{enabled: true, staleness: 0}"),
        ("stale1", "{enabled: true, staleness: 1}"),
    ]:
        sets = [
            f"data.path={clicks}",
            "variant=optimized",
            f"steps={STEPS}",
            "deterministic=true",
            "eval={every: 0, batch_size: 500}",
            f"output_dir={root}",
            f"run_id={run_id}",
            f"pipeline={pipeline}",
            f"checkpoint_every={STEPS}",
            "tensorboard=false",
        ]
        supervise("configs/jobs/dlrm_criteo.yaml", sets)
    return root


def test_exact_mode_ends_bitwise_equal_to_the_job_without_a_pipeline(runs: Path) -> None:
    plain, exact = final_state(runs / "plain", STEPS), final_state(runs / "exact", STEPS)
    # Dense parameters and Adam state of the trainers, rows and row-wise Adagrad state of the server.
    assert bitwise_equal(plain["dense"], exact["dense"])
    assert bitwise_equal(plain["tables"], exact["tables"])
    assert [r["loss"] for r in records(runs / "plain", "step")] == [
        r["loss"] for r in records(runs / "exact", "step")
    ]
    assert {r["staleness_max"] for r in records(runs / "exact", "step")} == {0}


def test_staleness_one_keeps_the_held_out_auc_and_logs_its_staleness(runs: Path) -> None:
    exact, stale = records(runs / "exact", "eval")[-1], records(runs / "stale1", "eval")[-1]
    assert exact["step"] == stale["step"] == STEPS
    assert abs(stale["eval_auc"] - exact["eval_auc"]) <= 0.005, (exact, stale)
    steps = records(runs / "stale1", "step")
    assert max(r["staleness_max"] for r in steps) == 1  # rows do miss an update, never two
    assert all(0 <= r["staleness_mean"] <= 1 and r["prefetch_bytes"] >= 0 for r in steps)
