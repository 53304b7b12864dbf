"""Integration: processes, Slurm jobs and Ray actors across the hosts of the multi-host cluster.

Nothing here uses a distopt launcher: these tests prove the cluster itself
(``launchers.multihost``), the way a multi-node job reaches it. Ranks on two nodes find each other
by node address (torchrun) or node name (Slurm), a 2-node Slurm job runs one task on each node,
srun works from the login host, and a Ray job submitted from the login host places an actor on the
worker node.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from launchers.slurm.cluster import running as slurm_running
from tests.launchers.conftest import REPO

pytestmark = [pytest.mark.slow, pytest.mark.cluster]

NODES = ("node0", "node1")
TORCHRUN = str(Path(sys.executable).with_name("torchrun"))
ALLREDUCE = str(REPO / "tests/launchers/allreduce_job.py")
SLURM_ACTIVE = ("PENDING", "CONFIGURING", "RUNNING", "COMPLETING")


def records(text: str) -> list[dict[str, Any]]:
    """The JSON lines of ``text``, by rank or in order."""
    lines = [json.loads(line) for line in text.splitlines() if line.startswith("{")]
    return sorted(lines, key=lambda r: r.get("rank", 0))


def sbatch(cluster: Any, tmp_path: Path, script: str, timeout: float = 180) -> str:
    """Submit ``script`` from the login host, wait for it, return its output file's text.

    Polls ``scontrol`` every half second: ``sbatch --wait`` doubles its poll interval up to 32 s.
    """
    out, path = tmp_path / "job.out", tmp_path / "job.sh"
    path.write_text(f"#!/bin/sh\n#SBATCH -N 2 --ntasks-per-node=1 -o {out}\n{script}\n")
    env = {"PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin", **cluster.env()}

    def slurm(*args: str) -> str:
        done = subprocess.run(args, capture_output=True, text=True, env=env, timeout=30)
        assert done.returncode == 0, done.stderr
        return done.stdout

    job = slurm("sbatch", "--parsable", str(path)).strip()
    deadline = time.monotonic() + timeout
    while (state := _job_state(slurm("scontrol", "show", "job", "-o", job))) in SLURM_ACTIVE:
        assert time.monotonic() < deadline, f"job {job} still {state} after {timeout}s"
        time.sleep(0.5)
    text = out.read_text() if out.exists() else ""
    assert state == "COMPLETED", f"job {job} {state}: {text[-3000:]}"
    return text


def _job_state(scontrol_line: str) -> str:
    fields = dict(f.split("=", 1) for f in scontrol_line.split() if "=" in f)
    return fields["JobState"]


def daemon_pids(state: Path) -> dict[str, str]:
    files = [*(state / "slurm" / "pids").glob("*.pid"), *(state / "ray").glob("*/ray.pid")]
    return {str(path.relative_to(state)): path.read_text() for path in files}


def test_up_again_returns_the_running_cluster(multihost_cluster) -> None:
    from launchers.multihost import cluster as multihost

    state = Path(multihost_cluster.state_dir)
    pids = daemon_pids(state)
    assert len(pids) == 6 + 2  # munged, mariadbd, slurmdbd, slurmctld, 2 slurmd; 2 Ray nodes
    assert multihost.up(state, nodes=2) == multihost_cluster
    assert daemon_pids(state) == pids
    assert slurm_running(state / "slurm") is not None


def test_torchrun_gloo_all_reduce_across_two_nodes(multihost_cluster) -> None:
    cluster = multihost_cluster
    master = cluster.addr("node0")
    port = cluster.free_port("node0")
    procs = []
    for rank, node in enumerate(NODES):
        rendezvous = [f"--node-rank={rank}", f"--master-addr={master}", f"--master-port={port}"]
        cmd = [*cluster.run(node), TORCHRUN, "--nnodes=2", "--nproc-per-node=1", *rendezvous]
        env = {"GLOO_SOCKET_IFNAME": "eth0", "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"}
        pipes = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE}
        procs.append(subprocess.Popen([*cmd, ALLREDUCE], text=True, env=env, **pipes))
    outputs = [p.communicate(timeout=180) for p in procs]
    for p, (_, err) in zip(procs, outputs, strict=True):
        assert p.returncode == 0, err[-3000:]
    ranks = [records(out)[0] for out, _ in outputs]
    for rank, (node, record) in enumerate(zip(NODES, ranks, strict=True)):
        assert record["rank"] == rank and record["sum"] == 3.0
        assert record["hostname"] == node and record["addr"] == cluster.addr(node)


def test_a_slurm_job_runs_one_task_on_each_node(multihost_cluster, tmp_path) -> None:
    where = (
        "import json, os, socket; print(json.dumps({'rank': int(os.environ['SLURM_PROCID']), "
        "'nodename': os.environ['SLURMD_NODENAME'], 'hostname': socket.gethostname(), "
        "'addr': socket.gethostbyname(socket.gethostname())}))"
    )
    text = sbatch(multihost_cluster, tmp_path, f'srun python -c "{where}"')
    assert records(text) == [
        {"rank": rank, "nodename": node, "hostname": node, "addr": multihost_cluster.addr(node)}
        for rank, node in enumerate(NODES)
    ]


def test_srun_from_the_login_host_reaches_both_nodes(multihost_cluster) -> None:
    # srun listens on the login host for its tasks' output: slurmstepd on each node connects back.
    env = {"PATH": "/usr/bin:/bin", **multihost_cluster.env()}
    srun = ["srun", "-N2", "-l", "hostname"]
    out = subprocess.run(srun, capture_output=True, text=True, env=env, timeout=60)
    assert out.returncode == 0, out.stderr
    assert sorted(out.stdout.split()) == ["0:", "1:", *NODES]


def test_a_slurm_gloo_job_finds_its_master_by_node_name(multihost_cluster, tmp_path) -> None:
    # MASTER_ADDR is a node name; every node resolves it to node0's address.
    port = multihost_cluster.free_port("node0")
    script = (
        'export MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)\n'
        f"export MASTER_PORT={port} GLOO_SOCKET_IFNAME=eth0 OMP_NUM_THREADS=1\n"
        f"srun python {ALLREDUCE}"
    )
    ranks = records(sbatch(multihost_cluster, tmp_path, script))
    assert [r["rank"] for r in ranks] == [0, 1]
    for node, record in zip(NODES, ranks, strict=True):
        assert record["sum"] == 3.0 and record["master_addr"] == "node0"
        assert record["hostname"] == node and record["addr"] == multihost_cluster.addr(node)


def test_a_ray_job_from_the_login_host_places_an_actor_on_the_worker_node(
    multihost_cluster,
) -> None:
    from ray.job_submission import JobStatus, JobSubmissionClient

    cluster = multihost_cluster
    client = JobSubmissionClient(f"http://{cluster.ray_dashboard_address}")
    script = REPO / "tests/launchers/ray_where_job.py"
    job = client.submit_job(entrypoint=f"python {script} {cluster.addr('node1')}")
    deadline = time.monotonic() + 180
    done = (JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.STOPPED)
    while (status := client.get_job_status(job)) not in done:
        assert time.monotonic() < deadline, f"ray job {job} still {status}"
        time.sleep(0.5)
    logs = client.get_job_logs(job)
    assert status == JobStatus.SUCCEEDED, logs[-3000:]
    (record,) = records(logs)
    assert record == {
        "driver": {"hostname": "node0", "addr": cluster.addr("node0")},
        "actor": {"hostname": "node1", "addr": cluster.addr("node1")},
    }
