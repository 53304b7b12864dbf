"""Integration: distopt's Ray scheduler (``distopt_ray``) against a real local Ray head.

A two-role app (two replicas writing files, one more role) runs to SUCCEEDED, is listed and its
replicas' output comes back per replica; a long-running app is cancelled and its processes end.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from torchx import specs
from torchx.specs import AppState

from distopt.torchx.ray_scheduler import RayJobScheduler, create_scheduler
from launchers._proc import alive

pytestmark = [pytest.mark.slow, pytest.mark.cluster]

TERMINAL = {AppState.SUCCEEDED, AppState.FAILED, AppState.CANCELLED}


def _submit(sched: RayJobScheduler, cluster, app: specs.AppDef) -> str:
    cfg = {"dashboard_address": f"http://{cluster.dashboard_address}"}
    return sched.schedule(sched.submit_dryrun(app, cfg))


def _wait(sched: RayJobScheduler, app_id: str, states: set[AppState], timeout_s: float) -> AppState:
    deadline = time.monotonic() + timeout_s
    while True:
        desc = sched.describe(app_id)
        assert desc is not None, app_id
        if desc.state in states or time.monotonic() > deadline:
            return desc.state
        time.sleep(0.5)


def test_two_role_app_succeeds_and_reports(ray_cluster, tmp_path: Path) -> None:
    workdir, out = tmp_path / "workdir", tmp_path / "out"
    workdir.mkdir()
    out.mkdir()
    (workdir / "greeting.txt").write_text("hello")  # read from the uploaded working_dir
    write = (
        "import os; g = open('greeting.txt').read(); "
        f"open(os.path.join({str(out)!r}, 'writer-' + os.environ['REPLICA']), 'w')"
        ".write(g + ' from ' + os.environ['TORCHX_RANK0_HOST']); "
        "print(g, 'writer', os.environ['REPLICA'])"
    )
    writer = specs.Role(
        name="writer", image=str(workdir), entrypoint="python", args=["-c", write],
        num_replicas=2, env={"REPLICA": specs.macros.replica_id},
        resource=specs.Resource(cpu=1, gpu=0, memMB=64),
    )  # fmt: skip
    chief = specs.Role(
        name="chief", image=str(workdir), entrypoint="bash",
        args=["-c", "echo chief of ${app_id}; echo to stderr >&2"],
        resource=specs.Resource(cpu=1, gpu=0, memMB=64),
    )  # fmt: skip
    sched = create_scheduler("test")
    app_id = _submit(sched, ray_cluster, specs.AppDef("tworole", roles=[writer, chief]))
    assert app_id.startswith(f"{ray_cluster.dashboard_address}-tworole-")

    state = _wait(sched, app_id, TERMINAL, timeout_s=120)
    assert state == AppState.SUCCEEDED, "".join(sched.log_iter(app_id, ""))
    for i in range(2):
        assert (out / f"writer-{i}").read_text() == "hello from 127.0.0.1"
    desc = sched.describe(app_id)
    assert desc is not None
    assert [(r.name, r.num_replicas) for r in desc.roles] == [("writer", 2), ("chief", 1)]
    assert [len(s.replicas) for s in desc.roles_statuses] == [2, 1]

    listed = {
        a.app_id: a.state for a in sched.list({"dashboard_address": ray_cluster.dashboard_address})
    }
    assert listed[app_id] == AppState.SUCCEEDED

    assert list(sched.log_iter(app_id, "writer", k=1)) == ["hello writer 1\n"]
    submission_id = app_id.split("-", 1)[1]
    assert list(sched.log_iter(app_id, "chief")) == [
        f"chief of {submission_id}\n",
        "to stderr\n",
    ]
    assert list(sched.log_iter(app_id, "writer", k=0, regex="writer 0")) == ["hello writer 0\n"]
    everything = "".join(sched.log_iter(app_id, "", should_tail=True))
    assert "[writer/0] hello writer 0" in everything and "all 3 replicas succeeded" in everything


def test_cancel_ends_a_long_running_app(ray_cluster, tmp_path: Path) -> None:
    pid_file = tmp_path / "pid"
    loop = (
        f"import os, time; open({str(pid_file)!r}, 'w').write(str(os.getpid())); "
        "print('started', flush=True); time.sleep(600)"
    )
    role = specs.Role(
        name="sleeper", image=str(tmp_path), entrypoint="python", args=["-c", loop],
        resource=specs.Resource(cpu=1, gpu=0, memMB=64),
    )  # fmt: skip
    sched = create_scheduler("test")
    app_id = _submit(sched, ray_cluster, specs.AppDef("sleeper", roles=[role]))
    deadline = time.monotonic() + 90
    while not (pid_file.exists() and pid_file.read_text()):
        assert time.monotonic() < deadline, "".join(sched.log_iter(app_id, ""))
        time.sleep(0.5)
    pid = int(pid_file.read_text())
    assert _wait(sched, app_id, {AppState.RUNNING}, timeout_s=30) == AppState.RUNNING

    cancelled_at = time.monotonic()
    sched.cancel(app_id)
    assert _wait(sched, app_id, TERMINAL, timeout_s=30) == AppState.CANCELLED
    while alive(pid) and time.monotonic() - cancelled_at < 15:
        time.sleep(0.2)
    assert not alive(pid), f"replica process {pid} outlived the cancel"
    assert "started\n" in list(sched.log_iter(app_id, "sleeper"))
