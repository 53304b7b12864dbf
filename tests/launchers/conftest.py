"""Fixtures for launcher tests: a local Ray head and a local Slurm cluster, shared by test processes.

The clusters are session-scoped and shared between pytest-xdist workers through a state
directory, a lock and a list of user PIDs: the first user starts the cluster, the last one stops it
(teardown runs even when tests fail). Outside CI (``CI`` unset) a missing package skips the tests
with the reason; in CI it fails them.
"""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from distopt.data.generate import write_criteo
from distopt.dist.rendezvous import free_port
from distopt.metrics import load_run
from launchers._proc import alive

REPO = Path(__file__).resolve().parents[2]
TORCHX = str(Path(sys.executable).with_name("torchx"))
JOB_MODULE = "tests.launchers.rendezvous_job"


def in_ci() -> bool:
    return os.environ.get("CI", "").lower() not in ("", "0", "false")


def require(missing: list[str], what: str) -> None:
    """Skip (outside CI) or fail (in CI) when ``missing`` names absent prerequisites."""
    if missing:
        message = f"{what} needs {', '.join(missing)}"
        if in_ci():
            pytest.fail(f"{message} (CI must install them: .ci/run)")
        pytest.skip(message)


def free_port_pair() -> int:
    """A port ``p`` with ``p`` and ``p + 1`` free (ps_job uses MASTER_PORT and MASTER_PORT + 1)."""
    return free_port(consecutive=2)


def torchx(*args: str, cwd: Path = REPO, env: dict[str, str] | None = None,
           timeout: float = 120) -> subprocess.CompletedProcess[str]:  # fmt: skip
    """Run the torchx CLI of this venv."""
    full_env = dict(os.environ, **(env or {}))
    # The venv first on PATH, as after `source .venv/bin/activate`.
    full_env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{full_env.get('PATH', '')}"
    return subprocess.run([TORCHX, *args], cwd=cwd, env=full_env, capture_output=True,
                          text=True, timeout=timeout)  # fmt: skip


def job_config(tmp_path: Path, **values: Any) -> Path:
    """A YAML config for the rendezvous job with ``output_dir`` under ``tmp_path``."""
    values.setdefault("output_dir", str(tmp_path / "out"))
    path = tmp_path / "job.yaml"
    path.write_text("".join(f"{k}: {json.dumps(v)}\n" for k, v in values.items()))
    return path


def criteo_job_args(tmp_path: Path) -> list[str]:
    """``distopt.ps_job`` arguments running the config examples/dlrm_criteo.py launches on
    local_cwd, unchanged but for the data path and a shorter run (Criteo loading, evaluation and
    the optimized variant); :func:`assert_criteo_run` checks what it wrote."""
    clicks = write_criteo(tmp_path / "clicks.tsv", num_samples=1500, seed=0)
    return [
        "--config", str(REPO / "configs/jobs/dlrm_criteo.yaml"), "--output_dir", str(tmp_path / "runs"),
        "--run_id", "criteo", "--set", f"data.path={clicks},steps=6,eval.every=3,variant=optimized",
    ]  # fmt: skip


def assert_criteo_run(tmp_path: Path) -> None:
    run = load_run(tmp_path / "runs" / "criteo")
    assert run.world_size == 2 and run.merged_steps()[-1].step == 5
    evals = run.ranks[0].evals
    assert [e.step for e in evals] == [3, 6] and 0.0 <= evals[-1].metrics["eval_auc"] <= 1.0


def logged_steps(path: Path) -> list[int]:
    """The steps a QPS log holds so far: read while its job runs, so a line still being written
    (not yet ending in ``}``) is left for the next read."""
    if not path.exists():
        return []
    records = [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]
    return [r["step"] for r in records if r.get("type") == "step"]


def read_records(out: Path) -> dict[str, dict[str, Any]]:
    return {p.stem: json.loads(p.read_text()) for p in sorted(out.glob("*.jsonl"))}


def assert_rendezvous_ok(out: Path, *, num_ps: int = 1, num_trainers: int = 2) -> None:
    """Every replica wrote its record; the server got every push; trainers all-reduced them."""
    records = read_records(out)
    expected = {f"ps-{i}" for i in range(num_ps)} | {f"trainer-{i}" for i in range(num_trainers)}
    assert set(records) == expected, records
    pushed = [float(i + 1) for i in range(num_trainers)]
    assert records["ps-0"]["received"] == pushed
    for i in range(num_trainers):
        assert records[f"trainer-{i}"]["allreduce"] == sum(pushed)
        assert records[f"trainer-{i}"]["rank"] == num_ps + i
    assert {r["world_size"] for r in records.values()} == {num_ps + num_trainers}


@contextmanager
def shared_cluster(
    state_dir: Path, start: Callable[[], Any], stop: Callable[[], Any]
) -> Iterator[Any]:
    """Start (or join) the cluster in ``state_dir``; the last user to leave stops it."""
    state_dir.mkdir(parents=True, exist_ok=True)
    lock_path, users_path = state_dir / "users.lock", state_dir / "users.json"

    @contextmanager
    def locked() -> Iterator[list[int]]:
        with open(lock_path, "a+") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                users = json.loads(users_path.read_text()) if users_path.exists() else []
            except ValueError:
                users = []
            users = [pid for pid in users if alive(pid)]
            yield users
            users_path.write_text(json.dumps(users))

    with locked() as users:
        cluster = start()  # idempotent: returns the running cluster when there is one
        users.append(os.getpid())
    try:
        yield cluster
    finally:
        with locked() as users:
            if os.getpid() in users:
                users.remove(os.getpid())
            if not users:
                stop()


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[Any]:
    """A loopback Ray head with 4 logical CPUs (a 1 PS + 2 trainer job reserves 3)."""
    from importlib.util import find_spec

    require([] if find_spec("ray") else ["ray (pip install -e '.[ray]')"], "the Ray cluster test")
    from launchers.ray import cluster as ray_cluster_mod

    # Another checkout or venv (e.g. torchx-nightly's) keeps its own head with its own state dir.
    state = Path(os.environ.get("DISTOPT_RAY_TEST_STATE_DIR", "/tmp/distopt-ray-test"))
    with shared_cluster(
        state,
        start=lambda: ray_cluster_mod.start(state, num_cpus=4),
        stop=lambda: ray_cluster_mod.stop(state),
    ) as cluster:
        yield cluster


@pytest.fixture(scope="session")
def slurm_cluster() -> Iterator[Any]:
    """A single-host Slurm cluster with 4 virtual nodes (a 3-replica job takes 3)."""
    from launchers.slurm import cluster as slurm_mod

    missing = slurm_mod.missing_packages()
    if os.geteuid() != 0:
        missing.append("root (daemons run as munge/mysql)")
    require(missing, "the Slurm cluster test")
    state = Path("/tmp/distopt-slurm-test")
    with shared_cluster(
        state, start=lambda: slurm_mod.up(state, nodes=4), stop=lambda: slurm_mod.down(state)
    ) as cluster:
        yield cluster


def require_namespaces(*, slurm: bool = False, ray: bool = False) -> None:
    """Skip (outside CI) or fail (in CI) unless this process can build the multi-host cluster."""
    from importlib.util import find_spec

    from distopt.dist import netns
    from launchers.slurm import cluster as slurm_mod

    why = netns.rights_missing()
    missing = [why] if why else []
    if slurm:
        missing += slurm_mod.missing_packages()
    if ray and find_spec("ray") is None:
        missing.append("ray (pip install -e '.[ray]')")
    require(missing, "the multi-host cluster test")


@pytest.fixture(scope="session")
def multihost_cluster() -> Iterator[Any]:
    """Network namespaces as hosts: ``ctl`` (Slurm's controller), ``node0`` and ``node1`` (a
    slurmd each; the Ray head on node0, a Ray worker node on node1)."""
    require_namespaces(slurm=True, ray=True)
    from launchers.multihost import cluster as multihost

    state = Path(os.environ.get("DISTOPT_MULTIHOST_TEST_STATE_DIR", "/tmp/distopt-multihost-test"))
    with shared_cluster(
        state, start=lambda: multihost.up(state, nodes=2), stop=lambda: multihost.down(state)
    ) as cluster:
        yield cluster
