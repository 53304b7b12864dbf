"""The pipeline in a launched DLRM job on a Criteo-format file (2 trainers, 1 parameter server, the
processes of ``python -m distopt.train`` started by ``distopt.roles.supervise``)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from distopt.data.generate import write_criteo
from tests.pipeline.conftest import bitwise_equal

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
        command = [
            sys.executable,
            "-m",
            "distopt.roles.supervise",
            "--config",
            "configs/jobs/dlrm_criteo.yaml",
            "--num-ps",
            "1",
            "--num-trainers",
            "2",
            "--max-restarts",
            "0",
        ]
        for value in sets:
            command += ["--set", value]
        done = subprocess.run(command, capture_output=True, text=True, timeout=400)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return root


def _records(root: Path, run_id: str, kind: str) -> list[dict[str, Any]]:
    lines = (root / run_id / "qps-rank0.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["type"] == kind]


def _checkpoint(root: Path, run_id: str) -> dict[str, Any]:
    step = root / run_id / "checkpoints" / f"step-{STEPS:08d}"
    dense = root / f"{run_id}-dense.pt"
    dcp_to_torch_save(step / "dense", dense)
    return {
        "dense": torch.load(dense, weights_only=False),
        "tables": torch.load(step / "ps0.pt", weights_only=False),
    }


def test_exact_mode_ends_bitwise_equal_to_the_job_without_a_pipeline(runs: Path) -> None:
    plain, exact = _checkpoint(runs, "plain"), _checkpoint(runs, "exact")
    # Dense parameters and Adam state of the trainers, rows and row-wise Adagrad state of the server.
    assert bitwise_equal(plain["dense"], exact["dense"])
    assert bitwise_equal(plain["tables"], exact["tables"])
    assert [r["loss"] for r in _records(runs, "plain", "step")] == [
        r["loss"] for r in _records(runs, "exact", "step")
    ]
    assert {r["staleness_max"] for r in _records(runs, "exact", "step")} == {0}


def test_staleness_one_keeps_the_held_out_auc_and_logs_its_staleness(runs: Path) -> None:
    exact, stale = _records(runs, "exact", "eval")[-1], _records(runs, "stale1", "eval")[-1]
    assert exact["step"] == stale["step"] == STEPS
    assert abs(stale["eval_auc"] - exact["eval_auc"]) <= 0.005, (exact, stale)
    steps = _records(runs, "stale1", "step")
    assert max(r["staleness_max"] for r in steps) == 1  # rows do miss an update, never two
    assert all(0 <= r["staleness_mean"] <= 1 and r["prefetch_bytes"] >= 0 for r in steps)
