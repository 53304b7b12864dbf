"""Integration: ``distopt.train`` jobs whose parameter servers are Ray actors (``ps.backend: ray``).

Launched with ``distopt.launch`` on TorchX's ``local_cwd`` (2 trainers, the Criteo DLRM config of
examples/dlrm_criteo.py, ``deterministic: true``) against the loopback Ray head of the
``ray_cluster`` fixture: the app has the trainer role only, trainer 0 creates the actors, and the
job trains, evaluates and logs exactly as the same job on the RPC backend, whose checkpoints it
resumes (and the other way round).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torchx.specs import AppState

import distopt
from distopt.data.generate import write_criteo
from distopt.dist.rendezvous import free_port
from distopt.metrics.qps_log import RunLog, load_run
from distopt.training.checkpoint import latest_complete
from distopt.training.state import read_tensors
from tests.launchers.conftest import REPO, free_port_pair

pytest.importorskip("ray")

pytestmark = [pytest.mark.slow, pytest.mark.cluster]

CRITEO = REPO / "configs" / "jobs" / "dlrm_criteo.yaml"
STEPS = 6


@pytest.fixture(scope="module")
def clicks(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_criteo(tmp_path_factory.mktemp("data") / "clicks.tsv", num_samples=1500, seed=0)


def _launch(out: Path, run_id: str, clicks: Path, *sets: str) -> tuple[Any, list[str], str]:
    """Run the Criteo job on local_cwd with 2 trainers; its final state, its roles, the replicas'
    stderr."""
    overrides = [f"data.path={clicks}", f"output_dir={out / 'runs'}", f"steps={STEPS}", "eval.every=3",
                 "variant=optimized", *sets]  # fmt: skip
    job = distopt.launch(CRITEO, "local_cwd", overrides=overrides, num_trainers=2, run_id=run_id,
                         component_args={"master_port": free_port_pair()},
                         log_dir=str(out / "logs" / run_id))  # fmt: skip
    with job:
        roles = [role.name for role in job.runner.describe(job.handle).roles]
        status = job.wait(interval_s=0.5)
    logs = "".join(
        p.read_text(errors="replace") for p in sorted((out / "logs" / run_id).rglob("stderr.log"))
    )
    return status.state, roles, logs


def _on_ray(cluster: Any, namespace: str) -> list[str]:
    return [
        "ps.backend=ray",
        f"ps.ray_address={cluster.gcs_address}",
        f"ps.ray_namespace={namespace}",
    ]


def _losses(run: RunLog) -> dict[int, list[tuple[int, float | None]]]:
    return {rank: [(s.step, s.loss) for s in log.steps] for rank, log in run.ranks.items()}


def _tables(run_dir: Path) -> dict[str, torch.Tensor]:
    """The servers' shards (weights and optimizer state) in the run's newest checkpoint."""
    found = latest_complete(run_dir / "checkpoints")
    assert found is not None and found.step == STEPS
    return {k: v for k, v in read_tensors(found).items() if k.startswith("ps0/")}


def _server_actors(cluster: Any, prefix: str) -> list[Any]:
    """Every actor, dead or alive, of the Ray namespaces starting with ``prefix``."""
    from ray.util.state import list_actors

    actors = list_actors(address=f"http://{cluster.dashboard_address}", limit=1000, detail=True)
    return [a for a in actors if (a.ray_namespace or "").startswith(prefix)]


def _assert_all_dead(cluster: Any, prefix: str, timeout_s: float = 20.0) -> list[Any]:
    """Every server actor of ``prefix`` is dead (ray.kill is asynchronous: waits a little)."""
    deadline = time.monotonic() + timeout_s
    while True:
        actors = _server_actors(cluster, prefix)
        alive = [a for a in actors if a.state != "DEAD"]
        if not alive or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert actors and not alive, alive
    return actors


@pytest.fixture(scope="module")
def rpc_run(clicks: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The uninterrupted job on the RPC backend (one ``ps`` process): the reference."""
    out = tmp_path_factory.mktemp("rpc")
    state, roles, logs = _launch(out, "rpc", clicks, "checkpoint_every=2")
    assert state == AppState.SUCCEEDED, logs[-3000:]
    assert roles == ["ps", "trainer"]
    return out / "runs" / "rpc"


def test_ray_backed_job_has_trainers_only_and_equals_the_rpc_job(
    ray_cluster: Any, rpc_run: Path, clicks: Path, tmp_path: Path
) -> None:
    started = time.monotonic()
    state, roles, logs = _launch(
        tmp_path, "ray", clicks, "checkpoint_every=2", *_on_ray(ray_cluster, "rj-full")
    )
    assert state == AppState.SUCCEEDED, logs[-3000:]
    assert roles == ["trainer"]  # no ps role: trainer 0 created the actors
    run_dir = tmp_path / "runs" / "ray"
    run = load_run(run_dir)
    assert run.world_size == 2 and run.header["num_ps"] == 1
    assert [s.step for s in run.merged_steps()] == list(range(STEPS))
    evals = run.ranks[0].evals
    assert [e.step for e in evals] == [3, 6] and 0.0 <= evals[-1].metrics["eval_auc"] <= 1.0
    assert any((run_dir / "tensorboard").iterdir())
    reference = load_run(rpc_run)
    assert _losses(run) == _losses(reference)  # deterministic: true, bit for bit
    assert [e.metrics for e in evals] == [e.metrics for e in reference.ranks[0].evals]
    ours, theirs = _tables(run_dir), _tables(rpc_run)
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    # The actors ran in a placement group on 1 CPU each (ps.ray_num_cpus), and are gone.
    (actor,) = _assert_all_dead(ray_cluster, "rj-full-")
    assert actor.name == "ps0" and actor.placement_group_id
    assert actor.required_resources[f"CPU_group_{actor.placement_group_id}"] == 1.0, (
        actor.required_resources
    )
    print(f"ray-backed criteo job: {time.monotonic() - started:.1f}s")


def test_checkpoints_switch_backends_both_ways(
    ray_cluster: Any, rpc_run: Path, clicks: Path, tmp_path: Path
) -> None:
    """Steps 0-2 on RPC, 2-4 on Ray actors resuming the RPC checkpoint, 4-6 on RPC resuming the
    Ray one: the same losses and final tables as the uninterrupted RPC job."""
    segments: dict[int, list[tuple[int, float | None]]] = {0: [], 1: []}
    for stop, backend in ((2, []), (4, _on_ray(ray_cluster, "rj-switch")), (STEPS, [])):
        state, _, logs = _launch(tmp_path, "switch", clicks, "checkpoint_every=2", "resume=true",
                                 f"steps={stop}", *backend)  # fmt: skip
        assert state == AppState.SUCCEEDED, logs[-3000:]
        for rank, losses in _losses(load_run(tmp_path / "runs" / "switch")).items():
            segments[rank] += losses  # each launch rewrites the run's logs: collect them here
    assert segments == _losses(load_run(rpc_run))
    ours, theirs = _tables(tmp_path / "runs" / "switch"), _tables(rpc_run)
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    _assert_all_dead(ray_cluster, "rj-switch-")


def test_failing_trainers_fail_the_job_and_leave_no_actors(
    ray_cluster: Any, tmp_path: Path
) -> None:
    config = tmp_path / "job.yaml"
    config.write_text(
        "model: 'tests.training.remote_model:remote_mlp'\nmodel_kwargs: {fail_after: 3}\nsteps: 8\n"
        "parallel: ddp\nps: {rpc_timeout_s: 20, start_timeout_s: 30}\n"
    )
    job = distopt.launch(config, "local_cwd", num_trainers=2, run_id="fails",
                         overrides=[f"output_dir={tmp_path / 'runs'}", *_on_ray(ray_cluster, "rj-fail")],
                         component_args={"master_port": free_port_pair()}, log_dir=str(tmp_path / "logs"))  # fmt: skip
    with job:
        status = job.wait(interval_s=0.5)
    logs = "".join(
        p.read_text(errors="replace") for p in sorted((tmp_path / "logs").rglob("stderr.log"))
    )
    assert status.state == AppState.FAILED and "injected failure in forward call 4" in logs, logs[
        -3000:
    ]
    _assert_all_dead(ray_cluster, "rj-fail-")


def test_ray_address_local_is_one_private_instance_for_the_job(tmp_path: Path) -> None:
    """Trainer 0 starts Ray on the job's host; trainer 1 joins that instance (else it could not
    find the actors by name), and it ends with the job."""
    job = distopt.launch(REPO / "configs" / "jobs" / "ps_dlrm_tiny.yaml", "local_cwd", num_trainers=2,
                         run_id="local", overrides=[f"output_dir={tmp_path / 'runs'}", "steps=4",
                                                    "ps.backend=ray", "ps.ray_address=local"],
                         component_args={"master_port": free_port_pair()}, log_dir=str(tmp_path / "logs"))  # fmt: skip
    with job:
        status = job.wait(interval_s=0.5)
    logs = "".join(
        p.read_text(errors="replace") for p in sorted((tmp_path / "logs").rglob("stderr.log"))
    )
    assert status.state == AppState.SUCCEEDED, logs[-3000:]
    run = load_run(tmp_path / "runs" / "local")
    assert run.world_size == 2 and [s.step for s in run.merged_steps()] == [0, 1, 2, 3]


def test_no_ray_cluster_fails_the_job_in_one_line_before_any_step(tmp_path: Path) -> None:
    """Every trainer prints trainer 0's one line naming the key and the address, and exits 2."""
    port = free_port()  # closed
    started = time.monotonic()
    job = distopt.launch(CRITEO, "local_cwd", num_trainers=2, run_id="unreachable",
                         overrides=[f"data.path={write_criteo(tmp_path / 'c.tsv', num_samples=600)}",
                                    f"output_dir={tmp_path / 'runs'}", "ps.backend=ray",
                                    f"ps.ray_address=127.0.0.1:{port}", "ps.start_timeout_s=3"],
                         component_args={"master_port": free_port_pair()}, log_dir=str(tmp_path / "logs"))  # fmt: skip
    with job:
        status = job.wait(interval_s=0.5)
    elapsed = time.monotonic() - started
    line = (f"distopt.train: error: ps.ray_address: no Ray cluster reachable at 127.0.0.1:{port} "
            "within 3 s (ps.start_timeout_s): [Errno 111] Connection refused")  # fmt: skip
    for rank in (0, 1):
        (stderr,) = (tmp_path / "logs").rglob(f"trainer/{rank}/stderr.log")
        assert line in stderr.read_text().splitlines()
    assert status.state == AppState.FAILED
    assert not list((tmp_path / "runs" / "unreachable").glob("qps-rank*.jsonl"))  # no step
    print(f"unreachable Ray: job failed after {elapsed:.1f}s (start_timeout_s 3)")


@pytest.fixture(autouse=True)
def _no_ray_in_this_process() -> Iterator[None]:
    """The trainers connect to Ray, never the test process (the state API is plain HTTP)."""
    yield
    import ray

    assert not ray.is_initialized()
