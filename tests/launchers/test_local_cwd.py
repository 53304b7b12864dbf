"""Integration: distopt.ps_job through TorchX's local_cwd scheduler (no cluster needed)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from distopt.metrics.qps_log import load_run
from tests.launchers.conftest import JOB_MODULE, free_port_pair, job_config, torchx

pytestmark = pytest.mark.slow

TINY = "configs/jobs/ps_dlrm_tiny.yaml"


def test_real_ps_job_writes_qps_logs(tmp_path: Path) -> None:
    started = time.monotonic()
    out = torchx(
        "run", "-s", "local_cwd", "-cfg", f"log_dir={tmp_path / 'logs'}",
        "distopt.ps_job", "--config", TINY, "--output_dir", str(tmp_path / "runs"),
        "--set", "steps=5", "--run_id", "local", "--master_port", str(free_port_pair()),
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    assert "Job finished: SUCCEEDED" in out.stderr
    run = load_run(tmp_path / "runs" / "local")
    assert run.run_id == "local" and run.world_size == 2
    assert [step.step for step in run.merged_steps()][-1] == 4
    print(f"local_cwd real ps_job: {time.monotonic() - started:.1f}s")


def test_failing_trainer_fails_the_job(tmp_path: Path) -> None:
    config = job_config(tmp_path, fail_trainer=1)
    out = torchx(
        "run", "-s", "local_cwd", "-cfg", f"log_dir={tmp_path / 'logs'}",
        "distopt.ps_job", "--config", str(config), "--module", JOB_MODULE,
        "--master_port", str(free_port_pair()),
    )  # fmt: skip
    assert out.returncode == 1, out.stderr[-3000:]
    assert "Job finished: FAILED" in out.stderr
    assert "trainer 1: failing on purpose" in out.stderr
