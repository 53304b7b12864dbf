"""Integration: a ``distopt.train`` job on Ray server actors whose actor ``ps0`` is SIGKILLed
mid-run (``ps.backend: ray``).

The Criteo DLRM job of tests/launchers/test_ray_ps_backend.py (2 trainers, ``deterministic: true``)
on the loopback Ray head of the ``ray_cluster`` fixture, launched with ``distopt.launch`` on
TorchX's ``local_cwd``. With ``ps.max_restarts: 1`` every trainer goes back to the last checkpoint
and the job ends bit for bit where the same job without a kill ends; with ``ps.max_restarts: 0`` it
fails with the one-line error naming the actor, and killed twice with ``ps.max_restarts: 1`` it
recovers once, then fails in one line.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torchx.specs import AppState

import distopt
from distopt.data.generate import write_criteo
from distopt.metrics.qps_log import load_run
from distopt.training.checkpoint import latest_complete
from distopt.training.state import read_tensors
from tests.launchers.conftest import REPO, free_port_pair, logged_steps

pytest.importorskip("ray")

pytestmark = [pytest.mark.slow, pytest.mark.cluster]

CRITEO = REPO / "configs" / "jobs" / "dlrm_criteo.yaml"
STEPS, EVERY = 24, 4


@pytest.fixture(scope="module")
def clicks(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_criteo(tmp_path_factory.mktemp("data") / "clicks.tsv", num_samples=1500, seed=0)


def _overrides(
    out: Path, clicks: Path, cluster: Any, namespace: str, max_restarts: int
) -> list[str]:
    # 20 ms per server call: a step takes long enough that the kill lands mid-run.
    return [f"data.path={clicks}", f"output_dir={out / 'runs'}", f"steps={STEPS}", f"checkpoint_every={EVERY}",
            "eval.every=10", "variant=optimized", "ps.backend=ray", f"ps.ray_address={cluster.gcs_address}",
            f"ps.ray_namespace={namespace}", f"ps.max_restarts={max_restarts}", "ps.latency_ms=20",
            "ps.rpc_timeout_s=30"]  # fmt: skip


def _alive_actor(cluster: Any, prefix: str, name: str, killed: set[int]) -> Any | None:
    from ray.util.state import list_actors

    actors = list_actors(address=f"http://{cluster.dashboard_address}", limit=1000, detail=True)
    alive = [a for a in actors if (a.ray_namespace or "").startswith(prefix) and a.name == name
             and a.state == "ALIVE" and a.pid and a.pid not in killed]  # fmt: skip
    return alive[0] if alive else None


def _wait_for(what: str, found: Any) -> Any:
    deadline = time.monotonic() + 300
    while not (value := found()):
        assert time.monotonic() < deadline, f"the job never reached {what}"
        time.sleep(0.05)
    return value


def _launch(out: Path, run_id: str, overrides: list[str], *,
            kill: tuple[Any, str, tuple[int, ...]] | None = None) -> tuple[Any, str]:  # fmt: skip
    """Run the job; with ``kill=(cluster, namespace, steps)``, SIGKILL its actor ps0 (by PID) once
    trainer 0 has logged each of ``steps`` (an actor restarted in between: once it is up). The
    final state and the trainers' stderr."""
    job = distopt.launch(CRITEO, "local_cwd", overrides=overrides, num_trainers=2, run_id=run_id,
                         component_args={"master_port": free_port_pair()},
                         log_dir=str(out / "logs" / run_id))  # fmt: skip
    with job:
        if kill is not None:
            cluster, namespace, steps = kill
            log, killed = out / "runs" / run_id / "qps-rank0.jsonl", set()
            for step in steps:
                actor = _wait_for(
                    "a live actor ps0",
                    lambda: _alive_actor(cluster, f"{namespace}-", "ps0", killed),
                )
                _wait_for(f"step {step}", lambda at=step: at in logged_steps(log))
                os.kill(actor.pid, signal.SIGKILL)
                killed.add(actor.pid)
                assert max(logged_steps(log)) < STEPS - 1, "the kill came too late to land mid-run"
        status = job.wait(interval_s=0.5)
    logs = "".join(
        p.read_text(errors="replace") for p in sorted((out / "logs" / run_id).rglob("stderr.log"))
    )
    return status.state, logs


def _final(run_dir: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the last checkpoint: dense model and optimizer, the server's tables."""
    found = latest_complete(run_dir / "checkpoints")
    assert found is not None and found.step == STEPS
    return read_tensors(found)


@pytest.fixture(scope="module")
def uninterrupted(ray_cluster: Any, clicks: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same job, recovery enabled (its per-step agreement included), with no kill."""
    out = tmp_path_factory.mktemp("uninterrupted")
    state, logs = _launch(out, "whole", _overrides(out, clicks, ray_cluster, "rr-whole", 1))
    assert state == AppState.SUCCEEDED, logs[-3000:]
    return out / "runs" / "whole"


@pytest.mark.parametrize("kill_after", [0, 5], ids=["before-any-checkpoint", "past-a-checkpoint"])
def test_a_killed_server_actor_rolls_every_trainer_back_and_the_job_ends_as_an_uninterrupted_one(
    ray_cluster: Any, uninterrupted: Path, clicks: Path, tmp_path: Path, kill_after: int
) -> None:
    """Killed after step 0 (the first checkpoint comes after step 3): the servers go back to their
    seeded tables and the trainers to step 0; after step 5: to the checkpoint after step 4 or 8."""
    started = time.monotonic()
    namespace = f"rr-kill{kill_after}"
    overrides = _overrides(tmp_path, clicks, ray_cluster, namespace, 1)
    state, logs = _launch(
        tmp_path, "killed", overrides, kill=(ray_cluster, namespace, (kill_after,))
    )
    assert state == AppState.SUCCEEDED, logs[-4000:]
    lines = [
        ln
        for ln in logs.splitlines()
        if "distopt.training.recovery: recovery 1 of 1: ps0 lost at step" in ln
    ]
    assert len(lines) == 2, logs[-4000:]  # one line on each trainer
    back = "the seeded tables (step 0)" if kill_after == 0 else "checkpoint "
    assert f"every trainer and server back at {back}" in lines[0], lines[0]

    run, reference = load_run(tmp_path / "runs" / "killed"), load_run(uninterrupted)
    for rank in (0, 1):
        footer = run.ranks[rank].footer
        assert footer is not None and footer["status"] == "ok", footer
        (recovery,) = footer["recoveries"]
        assert recovery["server"] == "ps0" and kill_after <= recovery["failed_step"]
        if kill_after == 0:
            assert recovery["resumed_from"] == 0 and recovery["checkpoint"] is None
        else:
            assert (
                recovery["resumed_from"] in (4, 8)
                and recovery["resumed_from"] <= recovery["failed_step"]
            )
        # Each step once, the re-run ones replacing those after the checkpoint: the same losses.
        assert [(s.step, s.loss) for s in run.ranks[rank].steps] == [
            (s.step, s.loss) for s in reference.ranks[rank].steps]  # fmt: skip
    assert [e.metrics for e in run.ranks[0].evals] == [e.metrics for e in reference.ranks[0].evals]
    ours, theirs = _final(tmp_path / "runs" / "killed"), _final(uninterrupted)
    assert any(k.startswith("ps0/") for k in ours) and any(
        k.startswith("dense/model/") for k in ours
    )
    assert ours.keys() == theirs.keys()
    assert [k for k in ours if not torch.equal(ours[k], theirs[k])] == []
    print(f"killed ps0 after step {kill_after}, failed at step {recovery['failed_step']}, recovered from step "
          f"{recovery['resumed_from']}: "
          f"{time.monotonic() - started:.1f}s")  # fmt: skip


def test_without_restarts_a_killed_server_actor_fails_the_job_in_one_line(
    ray_cluster: Any, clicks: Path, tmp_path: Path
) -> None:
    overrides = _overrides(tmp_path, clicks, ray_cluster, "rr-norestart", 0)
    state, logs = _launch(tmp_path, "dies", overrides, kill=(ray_cluster, "rr-norestart", (5,)))
    assert state == AppState.FAILED, logs[-3000:]
    errors = [ln for ln in logs.splitlines() if ln.startswith("distopt.train: error: ")]
    assert any(
        " on ps0 failed: the actor process exited or was killed (Ray: " in ln for ln in errors
    ), logs[-3000:]
    assert "recovery 1 of" not in logs


def test_recoveries_are_bounded_by_max_restarts(
    ray_cluster: Any, clicks: Path, tmp_path: Path
) -> None:
    """Killed twice with ``ps.max_restarts: 1``: one recovery, then the one-line error."""
    overrides = _overrides(tmp_path, clicks, ray_cluster, "rr-twice", 1)
    state, logs = _launch(tmp_path, "twice", overrides, kill=(ray_cluster, "rr-twice", (5, 12)))
    assert state == AppState.FAILED, logs[-3000:]
    assert logs.count("recovery 1 of 1: ps0 lost at step") == 2, logs[-3000:]
    errors = [
        ln for ln in logs.splitlines() if ln.startswith("distopt.train: error: ps0 lost at step ")
    ]
    assert errors and all(
        ln.endswith(": no recovery left (1 done, ps.max_restarts=1)") for ln in errors
    ), errors


@pytest.fixture(autouse=True)
def _no_ray_in_this_process() -> Iterator[None]:
    """The trainers connect to Ray, never the test process (the state API is plain HTTP)."""
    yield
    import ray

    assert not ray.is_initialized()
