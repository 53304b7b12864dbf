"""Integration: distopt jobs across the hosts of the multi-host cluster, launched as a user does.

Every job goes through ``distopt launch -s slurm`` from the login host with distopt's defaults
(``--iface auto``): each process takes the interface of its route toward the first node, so
nothing here names an interface unless a test is about naming a wrong one. The one-host reference
runs on this machine (``local_cwd``, loopback).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from distopt.metrics import load_run
from tests.launchers.conftest import REPO

pytestmark = [pytest.mark.slow, pytest.mark.cluster]

DISTOPT = str(Path(sys.executable).with_name("distopt"))
MLP_DDP = str(REPO / "configs/jobs/mlp_ddp.yaml")
PS_TINY = str(REPO / "configs/jobs/ps_dlrm_tiny.yaml")
NODES = ("node0", "node1")
WHOLE_NODE = ["--arg", "cpu=2"]
"""A node has 2 CPUs: a replica asking for both gets a node of its own."""


def distopt(cluster: Any, cwd: Path, *args: str, timeout: float = 150) -> subprocess.Popen[str]:
    """``distopt ARGS`` from the login host (Slurm clients configured for ``cluster``), started."""
    env = dict(os.environ, **cluster.env(), OMP_NUM_THREADS="1")
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    for key in ("GLOO_SOCKET_IFNAME", "TP_SOCKET_IFNAME", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)  # sbatch exports the submitter's environment to the job
    pipes = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE}
    return subprocess.Popen([DISTOPT, *args], cwd=cwd, env=env, text=True, **pipes)


def finish(proc: subprocess.Popen[str], timeout: float = 150) -> tuple[int, str, str]:
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        pytest.fail(f"distopt still running after {timeout}s: {out[-2000:]} {err[-2000:]}")
    return proc.returncode, out, err


def sets(tmp_path: Path, **values: Any) -> list[str]:
    values.setdefault("output_dir", str(tmp_path / "runs"))
    return [arg for k, v in values.items() for arg in ("--set", f"{k}={v}")]


def losses(run_dir: Path) -> dict[int, list[float]]:
    run = load_run(run_dir)
    return {rank: [s.loss for s in log.steps] for rank, log in run.ranks.items()}


def hosts(run_dir: Path) -> list[str]:
    """The host each rank's QPS log was written on (its header)."""
    found = []
    for path in sorted(run_dir.glob("qps-rank*.jsonl")):
        header = json.loads(path.read_text().splitlines()[0])
        found.append(header["host"]["hostname"])
    return found


def sacct_nodes(cluster: Any, job_id: str) -> dict[str, str]:
    """The node of each heterogeneous component of a finished Slurm job (``1+0``: ``node0``)."""
    env = {"PATH": "/usr/bin:/bin", **cluster.env()}
    fmt = ["--format=JobID,NodeList", "-P", "-n", "-X"]
    done = subprocess.run(
        ["sacct", "-j", job_id, *fmt], capture_output=True, text=True, env=env, timeout=30
    )
    assert done.returncode == 0, done.stderr
    return dict(line.split("|") for line in done.stdout.split())


def job_id(stdout: str) -> str:
    handle = next(line for line in stdout.splitlines() if line.startswith("slurm://"))
    return handle.rsplit("/", 1)[1]


@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_data_parallel_over_two_nodes_matches_the_same_job_on_one_host(
    multihost_cluster, tmp_path, parallel: str
) -> None:
    values = {"steps": 8, "deterministic": "true", "checkpoint_every": 0, "parallel": parallel}
    common = [MLP_DDP, *sets(tmp_path, **values)]
    started = time.monotonic()
    two_nodes = distopt(
        multihost_cluster, tmp_path, "launch", *common, "-s", "slurm", "--num-trainers", "1",
        "--arg", "nnodes=2", *WHOLE_NODE, "--run-id", "two-nodes", "--wait",
    )  # fmt: skip
    one_host = distopt(
        multihost_cluster, tmp_path, "launch", *common, "--num-trainers", "2",
        "--run-id", "one-host",
    )  # fmt: skip
    for proc in (two_nodes, one_host):
        code, out, err = finish(proc)
        assert code == 0, out[-2000:] + err[-3000:]
        assert "Traceback" not in err and "Warning" not in err, err[-3000:]
    across, alone = losses(tmp_path / "runs/two-nodes"), losses(tmp_path / "runs/one-host")
    assert len(across[0]) == 8 and across == alone  # deterministic: true, bit for bit
    assert hosts(tmp_path / "runs/two-nodes") == list(NODES)
    print(f"{parallel} over 2 nodes and on one host: {time.monotonic() - started:.1f}s")


def test_a_ps_job_with_servers_and_trainers_on_different_nodes(multihost_cluster, tmp_path) -> None:
    started = time.monotonic()
    placed: dict[str, dict[str, str]] = {}
    for variant in ("baseline", "optimized"):
        launched = distopt(
            multihost_cluster, tmp_path, "launch", PS_TINY, "-s", "slurm", "--num-ps", "1",
            "--num-trainers", "1", *WHOLE_NODE, *sets(tmp_path, steps=12, variant=variant),
            "--run-id", variant, "--wait",
        )  # fmt: skip
        code, out, err = finish(launched)
        assert code == 0, out[-2000:] + err[-3000:]
        assert "Traceback" not in err, err[-3000:]
        placed[variant] = sacct_nodes(multihost_cluster, job_id(out))
    for variant, nodes in placed.items():
        # Component 0 is the ps role, 1 the trainer role: one node each.
        ps_node, trainer_node = (nodes[k] for k in sorted(nodes))
        assert {ps_node, trainer_node} == set(NODES), nodes
        assert hosts(tmp_path / "runs" / variant) == [trainer_node]
    compared = subprocess.run(
        [DISTOPT, "compare", str(tmp_path / "runs/baseline"), str(tmp_path / "runs/optimized")],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert compared.returncode == 0, compared.stdout + compared.stderr
    assert "baseline" in compared.stdout and "optimized" in compared.stdout
    print(f"ps job across 2 nodes, both variants: {time.monotonic() - started:.1f}s")


def test_loopback_named_on_a_multi_node_job_fails_in_one_line_naming_the_node(
    multihost_cluster, tmp_path
) -> None:
    started = time.monotonic()
    launched = distopt(
        multihost_cluster, tmp_path, "launch", MLP_DDP, *sets(tmp_path, steps=4), "-s", "slurm",
        "--num-trainers", "1", "--arg", "nnodes=2", *WHOLE_NODE, "--arg", "iface=lo", "--wait",
    )  # fmt: skip
    code, out, err = finish(launched)
    assert code == 1, out[-2000:] + err[-3000:]
    first = err.strip().splitlines()[0]
    address = multihost_cluster.addr("node0")
    assert first.endswith(
        ": GLOO_SOCKET_IFNAME (--iface): 'lo' is loopback, which cannot reach MASTER_ADDR node0 "
        f"({address}); set GLOO_SOCKET_IFNAME (--iface) to 'auto' or to the interface that "
        "reaches it"
    ), err[-3000:]
    assert "failed first" in first and re.search(r"[:)] node[01]: GLOO_SOCKET_IFNAME", first), first
    print(f"--iface lo over 2 nodes failed in {time.monotonic() - started:.1f}s")


@pytest.fixture
def private_hosts(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """Hosts ctl, node0 and node1 without daemons, for a test that cuts a link (the shared
    cluster's Slurm would mark the node down for the tests running beside it)."""
    from launchers.multihost import cluster as multihost
    from tests.launchers.conftest import require_namespaces

    require_namespaces()
    state = tmp_path_factory.mktemp("multihost-cut")
    cluster = multihost.up(state, nodes=2, slurm=False, ray=False)
    try:
        yield cluster
    finally:
        multihost.down(state)


def test_a_node_losing_its_link_mid_step_fails_the_job_in_one_line_naming_it(
    private_hosts, tmp_path
) -> None:
    from distopt.dist import netns

    cluster = private_hosts
    port = cluster.free_port("node0")
    torchrun = str(Path(sys.executable).with_name("torchrun"))
    train = [
        "-m", "distopt.train", "--config", MLP_DDP,
        *sets(tmp_path, steps=100_000, collective_timeout_s=10, checkpoint_every=0, log_every=1),
    ]  # fmt: skip
    env = {"PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin", "OMP_NUM_THREADS": "1"}
    procs = []
    for rank, node in enumerate(NODES):
        rendezvous = [f"--node-rank={rank}", f"--master-addr={cluster.addr('node0')}"]
        cmd = [*cluster.run(node), torchrun, "--nnodes=2", "--nproc-per-node=1", *rendezvous]
        procs.append(
            subprocess.Popen(
                [*cmd, f"--master-port={port}", *train], env=env, text=True,
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
            )
        )  # fmt: skip
    try:
        log = tmp_path / "runs"
        deadline = time.monotonic() + 90
        while not any(p.stat().st_size > 4000 for p in log.glob("*/qps-rank0.jsonl")):
            assert time.monotonic() < deadline, "no steps within 90 s"
            assert procs[0].poll() is None, procs[0].communicate()[1][-3000:]
            time.sleep(0.5)
        netns.set_link(cluster.network, "node1", up=False)
        cut = time.monotonic()
        _, err = procs[0].communicate(timeout=60)
        failed_after = time.monotonic() - cut
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, 9)
            proc.communicate()
    errors = [line for line in err.splitlines() if line.startswith("distopt.train: error:")]
    assert procs[0].returncode != 0 and len(errors) == 1, err[-3000:]
    assert re.fullmatch(
        r"distopt\.train: error: trainer 0: trainer 1 \(on node1\) did not reach a collective at "
        r"step \d+ within collective_timeout_s \(its host died, hangs or lost its link\): .+",
        errors[0],
    ), errors[0]
    assert failed_after < 10 + 20  # the timeout, then the process's exit
    print(f"node1's link cut: trainer 0 failed {failed_after:.1f}s later")
