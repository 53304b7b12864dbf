"""A user's job launched on a local Ray cluster as a new user did: ``distopt launch job.yaml -s
distopt_ray --wait`` and ``-s ray --wait`` from the job's folder outside the repository, with
``output_dir: runs``. Ray runs the job's processes in its copy of that folder (``working_dir``);
they see the folder the launch wrote ``runs/<run-id>/job.yaml`` to, so they write their logs
there, where ``distopt launch`` says they are, and ``distopt compare`` reads both runs. (Before,
the logs stayed in Ray's copy and ``distopt compare runs/...`` found nothing.)"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from distopt.metrics import load_run
from tests.launchers.conftest import free_port_pair, ray_cluster  # noqa: F401  (a fixture)
from tests.noise import noise
from tests.user_jobs.as_user import copy_out, distopt_cli

pytestmark = pytest.mark.slow


def _launch(
    work: Path, cluster: object, scheduler: str, variant: str
) -> subprocess.CompletedProcess[str]:
    proc = distopt_cli(
        "launch", "job.yaml", "-s", scheduler, "--wait",
        "--cfg", f"dashboard_address={cluster.dashboard_address}",  # type: ignore[attr-defined]
        "--set", f"variant={variant}", "--set", "steps=10", "--run-id", variant,
        "--arg", f"master_port={free_port_pair()}",
        cwd=work,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert proc.stdout.splitlines()[1] == f"run id {variant}: logs in runs/{variant}", proc.stdout
    return proc


def test_ray_runs_write_their_logs_where_launch_says(tmp_path: Path, ray_cluster) -> None:  # noqa: F811
    work = copy_out("ps_stream", tmp_path)
    # distopt's Ray scheduler tails trainer 0's log: its progress streams while the job runs.
    ours = _launch(work, ray_cluster, "distopt_ray", "baseline")
    progress = [line for line in ours.stderr.splitlines() if "progress: step " in line]
    assert progress and all(line.startswith("trainer/0 ") for line in progress), ours.stderr
    final = f"run baseline: 10 steps, QPS log {work / 'runs' / 'baseline' / 'qps-rank0.jsonl'}"
    assert any(line.endswith(final) for line in ours.stderr.splitlines()), ours.stderr[-3000:]
    assert noise(ours.stderr) == [], ours.stderr[-3000:]
    # TorchX's own (0.7) streams nothing, but its processes write to the same place.
    _launch(work, ray_cluster, "ray", "optimized")
    for variant in ("baseline", "optimized"):
        run = load_run(work / "runs" / variant)
        assert run.world_size == 2 and run.merged_steps()[-1].step == 9
    compared = distopt_cli("compare", "runs/baseline", "runs/optimized", cwd=work)
    assert compared.returncode == 0, compared.stderr[-3000:]
    assert "runs/optimized" in compared.stdout
