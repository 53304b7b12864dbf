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
from distopt.metrics.qps_log import read_log
from tests.launchers.conftest import REPO, logged_steps

pytestmark = [pytest.mark.slow, pytest.mark.cluster]

DISTOPT = str(Path(sys.executable).with_name("distopt"))
MLP_DDP = str(REPO / "configs/jobs/mlp_ddp.yaml")
PS_TINY = str(REPO / "configs/jobs/ps_dlrm_tiny.yaml")
NODES = ("node0", "node1")
WHOLE_NODE = ["--arg", "cpu=2"]
"""A node has 2 CPUs: a replica asking for both gets a node of its own."""
OVER_THE_LINK = ["--set", "ps.channels=[basic]"]
"""Tensors between a trainer and a server over TCP: the hosts share process IDs, so TensorPipe's
default ``cma`` channel would copy them between the processes' memories, past the link."""


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
            *OVER_THE_LINK,
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


def _ray_job(cluster: Any, tmp_path: Path, run_id: str, *args: str) -> subprocess.Popen[str]:
    """``distopt launch -s distopt_ray`` of the tiny PS job from the login host, to the Ray head
    on node0, its server actors on node1 (Ray's own ``node:ADDR`` resource), a checkpoint every 4
    steps that a restarted actor reloads."""
    return distopt(
        cluster, tmp_path, "launch", PS_TINY, "-s", "distopt_ray",
        "--cfg", f"dashboard_address={cluster.ray_dashboard_address}",
        *sets(tmp_path, steps=12, checkpoint_every=4, deterministic="true", variant="optimized"),
        "--set", "ps.backend=ray", "--set", "ps.ray_address=auto", "--set", "ps.ray_num_cpus=0.5",
        "--set", f"ps.ray_state_dir={tmp_path / 'ray-state'}", "--set", "ps.latency_ms=20",
        "--set", f'ps.ray_resources={{"node:{cluster.addr("node1")}": 0.01}}',
        "--run-id", run_id, "--wait", *args,
    )  # fmt: skip


def _ray_servers(cluster: Any) -> list[Any]:
    """Every server actor the cluster has run (alive, dead or restarted)."""
    from ray.util.state import list_actors

    dashboard = f"http://{cluster.ray_dashboard_address}"
    actors = list_actors(address=dashboard, detail=True, limit=1000)
    return [a for a in actors if a.class_name == "PSServerActor"]


def test_a_ray_ps_job_from_the_login_host_on_actors_of_the_worker_node_survives_their_loss(
    multihost_cluster, tmp_path
) -> None:
    """The TorchX Ray scheduler submits across the namespace boundary; ``ps.ray_resources`` puts
    the server actors on node1; with ``ps.max_restarts: 1`` a killed actor is restarted there,
    every trainer rolls back to the last checkpoint and the job ends with the losses of the
    uninterrupted one; a resource no node has fails the job in one line naming the key."""
    from ray.util.state import list_nodes

    cluster = multihost_cluster
    node1 = cluster.addr("node1")
    started = time.monotonic()
    code, out, err = finish(_ray_job(cluster, tmp_path, "whole", "--set", "ps.max_restarts=1"))
    assert code == 0, out[-2000:] + err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    reference = load_run(tmp_path / "runs/whole")
    assert reference.merged_steps()[-1].step == 11
    # TorchX's Ray job spreads the two trainers over both nodes: node0's reaches node1's actors.
    assert sorted(hosts(tmp_path / "runs/whole")) == list(NODES)
    print(f"ray ps job with its servers on node1: {time.monotonic() - started:.1f}s")

    killed = _ray_job(cluster, tmp_path, "killed", "--set", "ps.max_restarts=1")
    log = tmp_path / "runs/killed/qps-rank0.jsonl"
    deadline = time.monotonic() + 180
    while _header_pid(log) is None:
        assert time.monotonic() < deadline and killed.poll() is None, "no step 5 within 180 s"
        time.sleep(0.2)
    (actor,) = [a for a in _ray_servers(cluster) if a.state == "ALIVE"]
    os.kill(actor.pid, 9)  # every namespace shares this machine's PIDs
    code, out, err = finish(killed, timeout=240)
    assert code == 0, out[-2000:] + err[-3000:]
    run = load_run(tmp_path / "runs/killed")
    for rank in (0, 1):
        (recovery,) = run.ranks[rank].footer["recoveries"]
        assert recovery["server"] == "ps0" and recovery["resumed_from"] in (4, 8)
        assert [(s.step, s.loss) for s in run.ranks[rank].steps] == [
            (s.step, s.loss) for s in reference.ranks[rank].steps
        ]
    addresses = {
        n.node_id: n.node_ip for n in list_nodes(address=f"http://{cluster.ray_dashboard_address}")
    }
    assert {addresses[a.node_id] for a in _ray_servers(cluster)} == {node1}
    print(
        f"ps0 killed on node1 at step 5, restarted there, recovered: {time.monotonic() - started:.1f}s"
    )

    nowhere = distopt(
        cluster, tmp_path, "launch", PS_TINY, "-s", "distopt_ray",
        "--cfg", f"dashboard_address={cluster.ray_dashboard_address}", *sets(tmp_path, steps=2),
        "--set", "ps.backend=ray", "--set", "ps.ray_address=auto", "--set", "ps.start_timeout_s=5",
        "--set", 'ps.ray_resources={"node:10.255.255.1": 0.01}', "--num-trainers", "1",
        "--run-id", "nowhere", "--wait",
    )  # fmt: skip
    code, out, err = finish(nowhere, timeout=240)
    assert code == 1, out[-2000:] + err[-3000:]
    # The launcher's stderr starts with Ray's INFO lines about the uploaded workspace.
    (failed,) = [line for line in err.splitlines() if ": FAILED: " in line]
    assert re.search(
        r": FAILED: trainer 0 failed first .*: distopt\.train: error: ps\.ray_resources: the Ray "
        r"cluster could not place 1 server actor of 1 CPU, 0\.01 node:10\.255\.255\.1 each \(PACK\) "
        r"within 5 s \(ps\.start_timeout_s\); no node has node:10\.255\.255\.1 \(nodes: "
        + re.escape(", ".join(f"node:{cluster.addr(n)}" for n in NODES)),
        failed,
    ), err[-3000:]


def _header_pid(log: Path) -> int | None:
    """The PID in a QPS log's header (the trainer that writes it), once it has logged step 5."""
    if not any(step >= 5 for step in logged_steps(log)):
        return None
    return int(json.loads(log.read_text().splitlines()[0])["host"]["pid"])


def test_a_ps_job_that_loses_its_trainer_node_mid_run_is_requeued_and_ends_as_an_uninterrupted_one(
    multihost_cluster, tmp_path
) -> None:
    """Slurm requeue across hosts: the trainer on one node is killed after step 5; the batch
    script requeues the job (``max_retries=1``), which resumes from the newest complete checkpoint
    (``SLURM_RESTART_COUNT``) and ends with the losses and tables of a job never interrupted."""
    values = {"steps": 12, "checkpoint_every": 4, "deterministic": "true", "ps.latency_ms": 20}
    common = [
        PS_TINY,
        "-s",
        "slurm",
        "--num-ps",
        "1",
        "--num-trainers",
        "1",
        *WHOLE_NODE,
        *OVER_THE_LINK,
    ]
    started = time.monotonic()
    whole = distopt(
        multihost_cluster, tmp_path, "launch", *common, *sets(tmp_path, **values),
        "--run-id", "whole", "--wait",
    )  # fmt: skip
    code, out, err = finish(whole, timeout=240)
    assert code == 0, out[-2000:] + err[-3000:]
    killed = distopt(
        multihost_cluster, tmp_path, "launch", *common, *sets(tmp_path, **values),
        "--arg", "max_retries=1", "--run-id", "killed", "--wait",
    )  # fmt: skip
    log = tmp_path / "runs/killed/qps-rank0.jsonl"
    deadline = time.monotonic() + 180
    while (pid := _header_pid(log)) is None:
        assert time.monotonic() < deadline and killed.poll() is None, "no step 5 within 180 s"
        time.sleep(0.2)
    os.kill(pid, 9)
    code, out, err = finish(killed, timeout=300)
    assert code == 0, out[-2000:] + err[-3000:]
    # The first attempt's log is kept as .1; the requeued attempt's log starts at its checkpoint
    # and from there repeats the uninterrupted job's losses bit for bit (deterministic: true).
    run = tmp_path / "runs/killed"
    first = [(s.step, s.loss) for s in read_log(run / "qps-rank0.jsonl.1").steps]
    second = [(s.step, s.loss) for s in read_log(run / "qps-rank0.jsonl").steps]
    reference = [(s.step, s.loss) for s in load_run(tmp_path / "runs/whole").ranks[0].steps]
    assert first[-1][0] >= 5 and first == reference[: len(first)]
    resumed = second[0][0]
    # resumed: the first step the new attempt runs, i.e. the steps the checkpoint holds.
    assert resumed in (4, 8) and resumed <= first[-1][0] + 1 and second == reference[resumed:]
    print(f"trainer killed at step 5, requeued, resumed: {time.monotonic() - started:.1f}s")
