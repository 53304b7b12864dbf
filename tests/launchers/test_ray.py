"""Integration: a local loopback Ray head, distopt's Ray scheduler and distopt.ps_job on Ray.

``distopt.ps_job`` runs through both scheduler names: ``ray`` with the torchx CLI (TorchX's own
on torchx 0.7.0; distopt's from plugins/torchx-ray where TorchX has none, e.g. torchx-nightly:
without it ``torchx run -s ray`` fails here) and ``distopt_ray`` with distopt's Runner
(:mod:`distopt.torchx.schedulers`, as ``distopt launch`` uses it). Either way every replica of
every role becomes one Ray actor running the role's command, and the job fails when any fails.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from torchx.specs import AppState

from distopt.metrics.qps_log import load_run
from distopt.torchx.schedulers import get_runner
from launchers._proc import session_members
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

TINY = "configs/jobs/ps_dlrm_tiny.yaml"
SCHEDULERS = ["ray", "distopt_ray"]


@dataclass
class Ran:
    """A finished ``distopt.ps_job`` app: whether it succeeded, its handle, status and logs."""

    ok: bool
    handle: str
    status: str
    logs: str


def _run_on_ray(cluster, *args: str, scheduler: str = "ray") -> Ran:
    args = ("--master_port", str(free_port_pair()), *args)
    cfg = f"dashboard_address={cluster.dashboard_address}"
    if scheduler == "distopt_ray":
        return _run_with_runner(scheduler, cfg, args)
    out = torchx(
        "run", "-s", scheduler, "--wait", "-cfg", cfg, "distopt.ps_job", *args, timeout=180
    )
    handles = [line for line in out.stdout.splitlines() if line.startswith(f"{scheduler}://")]
    assert handles, out.stderr[-3000:]
    status, logs = torchx("status", handles[-1]), torchx("log", handles[-1])
    return Ran(out.returncode == 0, handles[-1], status.stdout + status.stderr, logs.stdout)


def _run_with_runner(scheduler: str, cfg: str, args: tuple[str, ...]) -> Ran:
    with get_runner() as runner:
        opts = runner.scheduler_run_opts(scheduler).cfg_from_str(cfg)
        handle = runner.run_component("distopt.ps_job", list(args), scheduler, cfg=opts)
        status = runner.wait(handle, wait_interval=1)
        described = runner.describe(handle)
        logs = "".join(
            line
            for role in described.roles
            for k in range(role.num_replicas)
            for line in runner.log_lines(handle, role.name, k)
        )
    return Ran(status.state == AppState.SUCCEEDED, handle, f"State: {status.state.name}", logs)


def test_ray_head_listens_on_loopback_only(ray_cluster) -> None:
    pids = set(session_members(os.getsid(ray_cluster.pid)))
    listeners = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True, check=True).stdout
    ours = [line for line in listeners.splitlines() if any(f"pid={p}," in line for p in pids)]
    assert ours, listeners
    for line in ours:
        local = line.split()[3]
        assert local.startswith(("127.0.0.1:", "[::ffff:127.0.0.1]:")), line


@pytest.mark.parametrize("scheduler", SCHEDULERS)
def test_real_ps_job_on_ray(ray_cluster, tmp_path: Path, scheduler: str) -> None:
    started = time.monotonic()
    ran = _run_on_ray(
        ray_cluster,
        "--config",
        TINY,
        "--output_dir",
        str(tmp_path / "runs"),
        "--set",
        "steps=5",
        "--run_id",
        "ray",
        scheduler=scheduler,
    )
    assert ran.ok, ran.status + ran.logs[-3000:]
    run = load_run(tmp_path / "runs" / "ray")
    assert run.world_size == 2 and run.merged_steps()[-1].step == 4
    assert "State: SUCCEEDED" in ran.status, ran.status
    assert "run ray: 5 steps" in ran.logs, ran.logs[-2000:]
    print(f"{scheduler} real ps_job: {time.monotonic() - started:.1f}s")


def test_distopt_launch_on_distopt_ray(ray_cluster, tmp_path: Path) -> None:
    """The README's `distopt launch -s distopt_ray`: works on any TorchX, nothing registered."""
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "distopt",
            "launch",
            TINY,
            "-s",
            "distopt_ray",
            "--wait",
            "--cfg",
            f"dashboard_address={ray_cluster.dashboard_address}",
            "--run-id",
            "launched",
            "--set",
            f"output_dir={tmp_path / 'runs'}",
            "--set",
            "steps=5",
            "--arg",
            f"master_port={free_port_pair()}",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert out.stdout.startswith("distopt_ray://"), out.stdout
    run = load_run(tmp_path / "runs" / "launched")
    assert run.world_size == 2 and run.merged_steps()[-1].step == 4


def test_the_criteo_job_config_runs_on_ray(ray_cluster, tmp_path: Path) -> None:
    ran = _run_on_ray(ray_cluster, *criteo_job_args(tmp_path))
    assert ran.ok, ran.status + ran.logs[-3000:]
    assert_criteo_run(tmp_path)


@pytest.mark.parametrize("scheduler", SCHEDULERS)
def test_failing_trainer_fails_the_ray_job(ray_cluster, tmp_path: Path, scheduler: str) -> None:
    config = job_config(tmp_path, fail_trainer=1)
    ran = _run_on_ray(
        ray_cluster, "--config", str(config), "--module", JOB_MODULE, scheduler=scheduler
    )
    assert not ran.ok and "State: FAILED" in ran.status, ran.status + ran.logs[-3000:]


def test_the_head_runs_actors_at_its_own_priority() -> None:
    """Server actors on the loopback head are not reniced to Ray's default 15 (trainers run at 0:
    they would wait on starved servers on a busy host). A head of its own, probed from a fresh
    process (Ray is one connection per process)."""
    import tempfile

    pytest.importorskip("ray")
    from launchers.ray import cluster as ray_cluster_mod

    # Short: Ray's socket paths under the state dir must fit AF_UNIX's 107 bytes.
    state = Path(tempfile.mkdtemp(prefix="dr-", dir="/tmp"))
    head = ray_cluster_mod.start(state, num_cpus=1)
    try:
        script = (
            "import os, ray\n"
            "from distopt.ps.cluster.ray_placement import single_host\n"
            "single_host()\n"
            f"ray.init(address={head.gcs_address!r}, log_to_driver=False)\n"
            "@ray.remote\n"
            "class Probe:\n"
            "    def niceness(self):\n"
            "        return os.nice(0)\n"
            "print(ray.get(Probe.remote().niceness.remote()) - os.nice(0))\n"
            "ray.shutdown()\n"
        )
        env = {k: v for k, v in os.environ.items() if k != "RAY_worker_niceness"}
        done = subprocess.run(
            [sys.executable, "-c", script],
            capture_output=True,
            text=True,
            timeout=120,
            env={**env, "RAY_AUTH_MODE": "disabled"},
        )
        assert done.returncode == 0, done.stderr[-2000:]
        assert done.stdout.strip().splitlines()[-1] == "0"
    finally:
        ray_cluster_mod.stop(state)
        shutil.rmtree(state, ignore_errors=True)
