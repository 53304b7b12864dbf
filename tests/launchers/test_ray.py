"""Integration: a local loopback Ray head, distopt's Ray scheduler and distopt.ps_job on Ray.

``distopt.ps_job`` runs through both scheduler names: ``ray`` (TorchX's own on torchx 0.7.0,
distopt's where TorchX has none, e.g. torchx-nightly) and ``distopt_ray`` (always distopt's,
:mod:`distopt.launch.ray_scheduler`). The torchx CLI sees this checkout's entry points even where
the venv's distopt is another checkout's (tests/launch/entry_points.py). Either way every replica
of every role becomes one Ray actor running the role's command, and the job fails when any fails.
"""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest

from distopt.metrics.qps_log import load_run
from launchers._proc import session_members
from tests.launch.entry_points import checkout_entry_points_env
from tests.launchers.conftest import (
    JOB_MODULE,
    assert_criteo_run,
    criteo_job_args,
    free_port_pair,
    job_config,
    torchx,
)

pytestmark = [pytest.mark.slow, pytest.mark.cluster]

TINY = "configs/jobs/ps_dlrm_tiny.yaml"


@pytest.fixture(scope="module")
def entry_points_env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return checkout_entry_points_env(tmp_path_factory.mktemp("entry_points"))


def _run_on_ray(
    cluster, *args: str, scheduler: str = "ray", env: dict[str, str] | None = None
) -> tuple[subprocess.CompletedProcess[str], str]:
    out = torchx(
        "run", "-s", scheduler, "--wait", "-cfg", f"dashboard_address={cluster.dashboard_address}",
        "distopt.ps_job", "--master_port", str(free_port_pair()), *args, timeout=180, env=env,
    )  # fmt: skip
    handles = [line for line in out.stdout.splitlines() if line.startswith(f"{scheduler}://")]
    assert handles, out.stderr[-3000:]
    return out, handles[-1]


def test_ray_head_listens_on_loopback_only(ray_cluster) -> None:
    pids = set(session_members(os.getsid(ray_cluster.pid)))
    listeners = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True, check=True).stdout
    ours = [line for line in listeners.splitlines() if any(f"pid={p}," in line for p in pids)]
    assert ours, listeners
    for line in ours:
        local = line.split()[3]
        assert local.startswith(("127.0.0.1:", "[::ffff:127.0.0.1]:")), line


@pytest.mark.parametrize("scheduler", ["ray", "distopt_ray"])
def test_real_ps_job_on_ray(ray_cluster, tmp_path: Path, scheduler: str, entry_points_env) -> None:
    started = time.monotonic()
    out, handle = _run_on_ray(
        ray_cluster, "--config", TINY, "--output_dir", str(tmp_path / "runs"),
        "--set", "steps=5", "--run_id", "ray", scheduler=scheduler, env=entry_points_env,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    run = load_run(tmp_path / "runs" / "ray")
    assert run.world_size == 2 and run.merged_steps()[-1].step == 4
    status = torchx("status", handle, env=entry_points_env)
    assert "State: SUCCEEDED" in status.stdout, status.stdout + status.stderr
    logs = torchx("log", handle, env=entry_points_env)
    assert "run ray: 5 steps" in logs.stdout, logs.stdout[-2000:]
    print(f"{scheduler} real ps_job: {time.monotonic() - started:.1f}s")


def test_the_criteo_job_config_runs_on_ray(ray_cluster, tmp_path: Path) -> None:
    out, _ = _run_on_ray(ray_cluster, *criteo_job_args(tmp_path))
    assert out.returncode == 0, out.stderr[-3000:]
    assert_criteo_run(tmp_path)


@pytest.mark.parametrize("scheduler", ["ray", "distopt_ray"])
def test_failing_trainer_fails_the_ray_job(
    ray_cluster, tmp_path: Path, scheduler: str, entry_points_env
) -> None:
    config = job_config(tmp_path, fail_trainer=1)
    out, handle = _run_on_ray(
        ray_cluster, "--config", str(config), "--module", JOB_MODULE,
        scheduler=scheduler, env=entry_points_env,
    )  # fmt: skip
    assert out.returncode == 1, out.stderr[-3000:]
    status = torchx("status", handle, env=entry_points_env)
    assert "State: FAILED" in status.stdout, status.stdout + status.stderr
