"""distopt's Ray scheduler without a cluster: the job it would submit, its errors, its names.

How it reaches TorchX without changing TorchX: tests/torchx/test_schedulers.py. The same scheduler
against a real Ray head: tests/launchers/test_ray_scheduler_cluster.py and test_ray.py.
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest
from torchx import specs

from distopt.dist.rendezvous import free_port
from distopt.torchx import ray_scheduler
from distopt.torchx.ray_scheduler import (
    RayDashboardError,
    RayJobRequest,
    RayJobScheduler,
    create_ray_scheduler,
    create_scheduler,
)

pytest.importorskip("ray")


def _app(image: str = ".") -> specs.AppDef:
    worker = specs.Role(
        name="worker", image=image, entrypoint="python",
        args=["-c", "print('${replica_id}')"], num_replicas=2,
        env={"WHO": "worker-${replica_id}", "HOST_VAR": specs.macros.rank0_env},
        resource=specs.Resource(cpu=2, gpu=0, memMB=256),
    )  # fmt: skip
    chief = specs.Role(
        name="chief", image=image, entrypoint="echo", args=["${app_id}"],
        resource=specs.Resource(cpu=0, gpu=1, memMB=0),
    )  # fmt: skip
    return specs.AppDef(name="tiny", roles=[worker, chief])


def _dryrun(app: specs.AppDef, **cfg: str) -> RayJobRequest:
    cfg.setdefault("dashboard_address", "127.0.0.1:8265")
    return create_scheduler("test").submit_dryrun(app, cfg).request


def test_dryrun_is_one_job_with_every_replica(tmp_path: Path) -> None:
    req = _dryrun(_app(str(tmp_path)))
    assert req.dashboard_address == "127.0.0.1:8265"
    assert req.submission_id.startswith("tiny-")
    assert req.runtime_env["working_dir"] == str(tmp_path)
    assert req.runtime_env["env_vars"] == {"PYTHONUNBUFFERED": "1"}
    assert req.runtime_env["py_modules"] == [str(ray_scheduler.DRIVER)]
    assert json.loads(req.metadata["distopt.roles"]) == {"worker": 2, "chief": 1}
    got = [(r.role, r.replica_id, r.command, r.env, r.resources) for r in req.replicas]
    gib = 256 * 1024 * 1024
    assert got == [
        ("worker", 0, ["python", "-c", "print('0')"],
         {"WHO": "worker-0", "HOST_VAR": "TORCHX_RANK0_HOST"}, {"CPU": 2.0, "memory": gib}),
        ("worker", 1, ["python", "-c", "print('1')"],
         {"WHO": "worker-1", "HOST_VAR": "TORCHX_RANK0_HOST"}, {"CPU": 2.0, "memory": gib}),
        ("chief", 0, ["echo", req.submission_id], {}, {"CPU": 1.0, "GPU": 1.0}),
    ]  # fmt: skip
    # The driver receives exactly these replicas.
    module, spec = shlex.split(req.entrypoint)[2:]
    assert module == "ray_job_driver" == ray_scheduler.DRIVER.name
    assert [r["command"] for r in json.loads(spec)] == [r.command for r in req.replicas]


def test_working_dir_option_and_requirements(tmp_path: Path) -> None:
    (tmp_path / "requirements.txt").write_text("six\n")
    req = _dryrun(
        _app("some/container:image"), working_dir=str(tmp_path),
        requirements=str(tmp_path / "requirements.txt"),
    )  # fmt: skip
    assert req.runtime_env["working_dir"] == str(tmp_path)
    assert req.runtime_env["pip"] == str(tmp_path / "requirements.txt")
    assert "working_dir" not in _dryrun(_app("some/container:image")).runtime_env


def test_roles_in_different_directories_are_refused(tmp_path: Path) -> None:
    app = _app(str(tmp_path))
    (tmp_path / "b").mkdir()
    app.roles[1].image = str(tmp_path / "b")
    with pytest.raises(ValueError, match="one working_dir"):
        _dryrun(app)


@pytest.mark.parametrize("address", ["nohost", "127.0.0.1", "127.0.0.1:99999", "ftp://h:1"])
def test_malformed_dashboard_address_is_named(address: str) -> None:
    with pytest.raises(ValueError, match=f"dashboard_address='{address}'"):
        _dryrun(_app(), dashboard_address=address)


def test_unreachable_dashboard_is_one_line_naming_the_address() -> None:
    address = f"127.0.0.1:{free_port()}"  # nothing listens there
    sched = create_scheduler("test")
    info = sched.submit_dryrun(_app(), {"dashboard_address": f"http://{address}"})
    with pytest.raises(RayDashboardError) as err:
        sched.schedule(info)
    assert address in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(RayDashboardError, match=address):
        sched.describe(f"{address}-tiny-123")


def test_app_id_names_the_dashboard() -> None:
    split = ray_scheduler._split_app_id("127.0.0.1:8265-tiny-ab12")
    assert split == ("127.0.0.1:8265", "tiny-ab12")
    with pytest.raises(ValueError, match="'tiny'"):
        ray_scheduler._split_app_id("tiny")


def test_both_names_are_this_scheduler() -> None:
    for factory, name in [(create_scheduler, "distopt_ray"), (create_ray_scheduler, "ray")]:
        sched = factory("test")
        assert isinstance(sched, RayJobScheduler) and sched.backend == name
        assert set(sched.run_opts()._opts) == {"dashboard_address", "working_dir", "requirements"}
