"""examples/clusters: the .torchxconfig files give the Slurm and Ray requests the README says."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.examples.scripts import run_documented
from tests.examples.test_dlrm_criteo import load_example


def test_slurm_dryrun_uses_partition_time_and_component_defaults(tmp_path: Path) -> None:
    example = load_example("examples/clusters/dryrun.py")
    with example.dryrun("slurm", example.ROOT / "configs/jobs/dlrm_criteo.yaml", tmp_path) as job:
        script = str(job.dryrun)
    assert "--partition=gpu --time=04:00:00" in script and "--cpus-per-task=8 --mem=32000" in script
    assert "GLOO_SOCKET_IFNAME=ib0" in script and "exec python -m distopt.train" in script
    assert f"--config {tmp_path}/dryrun-slurm/job.yaml" in script


def test_ray_dryrun_targets_the_dashboard(tmp_path: Path) -> None:
    example = load_example("examples/clusters/dryrun.py")
    with example.dryrun("ray", example.ROOT / "configs/jobs/dlrm_criteo.yaml", tmp_path) as job:
        request = job.dryrun.request
    assert request.dashboard_address == "10.0.0.5:8265"
    assert [a.name for a in request.actors] == ["ps", "trainer", "trainer"]
    assert all(a.num_cpus == 4 and "GLOO_SOCKET_IFNAME" not in a.env for a in request.actors)


@pytest.mark.parametrize("scheduler", ["slurm", "ray"])
def test_the_dryrun_script_runs_as_its_docstring_says(scheduler: str) -> None:
    proc = run_documented("python", "examples/clusters/dryrun.py", scheduler)
    assert (
        ("--partition=gpu" in proc.stdout)
        if scheduler == "slurm"
        else ("10.0.0.5:8265" in proc.stdout)
    )
