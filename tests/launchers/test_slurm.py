"""Integration: a local single-host Slurm cluster and distopt.ps_job through TorchX (sbatch).

Each replica is one component of a heterogeneous job on its own virtual node; ``torchx log`` reads
the replicas' output files from the job directory recorded in the submit directory.
"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest

from distopt.metrics.qps_log import load_run
from tests.launchers.conftest import (
    JOB_MODULE,
    REPO,
    assert_criteo_run,
    criteo_job_args,
    free_port_pair,
    job_config,
    torchx,
)

pytestmark = [pytest.mark.slow, pytest.mark.cluster]

TINY = str(REPO / "configs/jobs/ps_dlrm_tiny.yaml")


def _run_on_slurm(
    cluster, submit_dir: Path, *args: str
) -> tuple[subprocess.CompletedProcess[str], str]:
    # Submitting from submit_dir keeps .torchxslurmjobdirs (torchx log's index) out of the repo;
    # job_dir receives a copy of the workspace and the replicas' slurm-*.out/err files.
    out = torchx(
        "run", "-s", "slurm", "--wait", "--workspace", f"file://{REPO}",
        "-cfg", f"job_dir={submit_dir / 'job'}", "distopt.ps_job",
        "--master_port", str(free_port_pair()), *args,
        cwd=submit_dir, env=cluster.env(), timeout=180,
    )  # fmt: skip
    handles = [line for line in out.stdout.splitlines() if line.startswith("slurm://")]
    assert handles, out.stderr[-3000:]
    return out, handles[-1]


def test_real_ps_job_on_slurm(slurm_cluster, tmp_path: Path) -> None:
    started = time.monotonic()
    out, handle = _run_on_slurm(
        slurm_cluster, tmp_path, "--config", TINY, "--output_dir", str(tmp_path / "runs"),
        "--set", "steps=5", "--run_id", "slurm",
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    run = load_run(tmp_path / "runs" / "slurm")
    assert run.world_size == 2 and run.merged_steps()[-1].step == 4
    status = torchx("status", handle, cwd=tmp_path, env=slurm_cluster.env())
    assert "State: SUCCEEDED" in status.stdout, status.stdout + status.stderr
    for role in ("ps", "trainer"):
        assert f"{role}[0]:SUCCEEDED" in status.stdout
    logs = torchx("log", "--streams", "stdout", handle, cwd=tmp_path, env=slurm_cluster.env())
    assert "trainer/0 run slurm: 5 steps" in logs.stdout, logs.stdout[-2000:] + logs.stderr[-2000:]
    print(f"slurm real ps_job: {time.monotonic() - started:.1f}s")


def test_the_criteo_job_config_runs_on_slurm(slurm_cluster, tmp_path: Path) -> None:
    out, _ = _run_on_slurm(slurm_cluster, tmp_path, *criteo_job_args(tmp_path))
    assert out.returncode == 0, out.stderr[-3000:]
    assert_criteo_run(tmp_path)


def test_failing_trainer_fails_the_slurm_job(slurm_cluster, tmp_path: Path) -> None:
    config = job_config(tmp_path, fail_trainer=1)
    out, handle = _run_on_slurm(
        slurm_cluster, tmp_path, "--config", str(config), "--module", JOB_MODULE
    )
    assert out.returncode == 1, out.stderr[-3000:]
    status = torchx("status", handle, cwd=tmp_path, env=slurm_cluster.env())
    assert "State: FAILED" in status.stdout, status.stdout + status.stderr
    logs = torchx(
        "log", "--streams", "stdout", f"{handle}/trainer/1", cwd=tmp_path, env=slurm_cluster.env()
    )
    assert "trainer 1: failing on purpose" in logs.stdout, _every_stderr(
        slurm_cluster, tmp_path, handle
    )


def _every_stderr(cluster, submit_dir: Path, handle: str) -> str:
    """Every replica's stderr, for a failure message: what ended the job when the expected line is
    missing (a replica that failed before the one meant to)."""
    text = []
    for replica in ("ps/0", "trainer/0", "trainer/1"):
        log = torchx(
            "log", "--streams", "stderr", f"{handle}/{replica}", cwd=submit_dir, env=cluster.env()
        )
        text.append(f"--- {replica} stderr ---\n{log.stdout[-1500:]}{log.stderr[-500:]}")
    return "\n".join(text)
