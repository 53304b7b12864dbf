"""Rendezvous with real stores and processes: loopback-only hosting, deadlines, a 2-trainer group."""

from __future__ import annotations

import multiprocessing
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from distopt.dist import rendezvous
from distopt.errors import RemoteCallError
from distopt.dist.rendezvous import StorePlan
from tests.conftest import free_port

ROOT = Path(__file__).resolve().parents[2]
_LOOPBACK = {"0100007F", "00000000000000000000000001000000"}  # 127.0.0.1 and ::1 in /proc/net
_DEADLINE_S = 1.5
_SLACK_S = 1.0  # our probe's deadline, not TCPStore's retry back-off (which took 5 s for 1.5 s)


def _listen_addresses(port: int) -> list[str]:
    """Addresses (hex, as in /proc/net/tcp*) that listen on ``port``."""
    found = []
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            address, _, port_hex = fields[1].partition(":")
            if fields[3] == "0A" and int(port_hex, 16) == port:  # 0A = LISTEN
                found.append(address)
    return found


def _outward_address() -> str | None:
    """This host's address on its default route (no packet is sent), if it has one."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("192.0.2.1", 9))  # TEST-NET-1: only picks the route
        except OSError:
            return None
        address = probe.getsockname()[0]
    return None if rendezvous.is_loopback(address) else address


def test_hosted_stores_listen_on_loopback_only() -> None:
    wanted = StorePlan(host="127.0.0.1", hosted_by="ps0", rpc_port=0, gloo_port=0)
    with rendezvous.host_stores(wanted, me="ps0", timeout_s=10.0) as hosted:
        ports = [hosted.plan.port("rpc"), hosted.plan.port("gloo")]
        assert len(set(ports)) == 2 and all(ports)
        for port in ports:
            addresses = _listen_addresses(port)
            assert addresses and set(addresses) <= _LOOPBACK, (port, addresses)
        outward = _outward_address()
        if outward is not None:  # the same port is closed on the host's network address
            with pytest.raises(OSError):
                socket.create_connection((outward, ports[0]), timeout=1.0).close()


def test_only_the_planned_host_hosts() -> None:
    plan = StorePlan(host="127.0.0.1", hosted_by="ps0", rpc_port=free_port())
    with rendezvous.host_stores(plan, me="trainer0", timeout_s=10.0) as hosted:
        assert hosted.plan == plan
        assert _listen_addresses(plan.port("rpc")) == []


def test_a_taken_port_is_one_line_naming_the_store_and_the_way_out() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        plan = StorePlan(host="127.0.0.1", hosted_by="ps0", rpc_port=port)
        with pytest.raises(Exception) as info:
            with rendezvous.host_stores(plan, me="ps0", timeout_s=10.0):
                pass
    assert str(info.value) == (
        f"ps0: cannot host the RPC group store on 127.0.0.1:{port}: Address already in use "
        "(another process listens there, perhaps another job: launch this one with "
        "--arg master_port=P, P and P + 1 free on that host)"
    )


def test_a_runs_port_is_its_own_and_the_same_wherever_computed() -> None:
    ports = [rendezvous.run_port(f"optimized-20261129-{i:06x}") for i in range(2000)]
    assert all(p in rendezvous.RUN_PORTS and p + 1 < 32768 for p in ports)
    # 2000 draws from 6384 pairs, uniform: 1718 distinct expected (1726 here); far fewer: clumped
    assert len(set(ports)) > 1650
    # A fresh interpreter (another PYTHONHASHSEED) computes the same port for a run.
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            "from distopt.dist.rendezvous import run_port; print(run_port('r'))",
        ],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "PYTHONHASHSEED": "7"},
    ).stdout
    assert int(out) == rendezvous.run_port("r")


def test_a_free_port_is_outside_the_ephemeral_range_and_its_neighbours_free_too() -> None:
    """A listening port in the ephemeral range can be taken by a client that connects to it
    before its server listens (a TCPStore client connected to itself: the suite's Ray job)."""
    ephemeral = rendezvous.ephemeral_ports()
    ports = [rendezvous.free_port(consecutive=2) for _ in range(50)]
    assert not any(p in ephemeral or p + 1 in ephemeral for p in ports)
    assert len(set(ports)) > 40  # two processes asking at once do not get the same one
    for port in ports:  # each pair was free, and nothing took it since
        for offset in (0, 1):
            socket.create_server(("127.0.0.1", port + offset)).close()


def test_a_plan_port_is_checked_on_load() -> None:
    with pytest.raises(
        Exception, match=r"rendezvous.gloo_port: expected a port in 0..65535, got 70000"
    ):
        StorePlan(host="127.0.0.1", hosted_by="trainer0", gloo_port=70000)


def _join_rpc(plan: StorePlan) -> None:
    rendezvous.meet(plan, me="trainer1", others=["ps0"], timeout_s=_DEADLINE_S)


def _join_gloo(plan: StorePlan) -> None:
    rendezvous.init_gloo(plan, me="trainer1", rank=1, world_size=2, timeout_s=_DEADLINE_S)


@pytest.mark.parametrize(
    ("join", "what"),
    [(_join_rpc, "RPC group store"), (_join_gloo, "trainers' gloo store")],
    ids=["rpc", "gloo"],
)
def test_an_unreachable_store_fails_within_the_deadline(join: Any, what: str) -> None:
    port = free_port()  # nothing listens there
    plan = StorePlan(host="127.0.0.1", hosted_by="ps0", rpc_port=port, gloo_port=port)
    start = time.monotonic()
    with pytest.raises(RemoteCallError) as caught:
        join(plan)
    assert time.monotonic() - start < _DEADLINE_S + _SLACK_S
    message = str(caught.value)
    assert "\n" not in message
    assert re.fullmatch(
        rf"trainer1: {what} \(hosted by ps0\) at 127\.0\.0\.1:{port} unreachable after 1\.5 s: .+",
        message,
    ), message


_ROLE_HARNESS = """
import sys, time
import distopt.roles.ps_roles, distopt.training.trainer, distopt.ps, distopt.train
start = time.monotonic()
code = distopt.train.main(sys.argv[1:])
print(f"joined or failed in {time.monotonic() - start:.3f} s")
sys.exit(code)
"""


@pytest.mark.slow
def test_a_torchx_trainer_role_fails_within_the_deadline(tmp_path: Path) -> None:
    # The trainer role of `python -m distopt.train` (TorchX ps_job, distopt.roles.supervise) when ps0's
    # stores are not there: imports happen before the clock starts, so only joining is timed.
    port, ddp_port = free_port(), free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DISTOPT_", "MASTER_"))}
    env.update(
        PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", DISTOPT_ROLE="trainer", DISTOPT_NUM_PS="1",
        DISTOPT_NUM_TRAINERS="2", REPLICA_ID="1", DISTOPT_PS_ADDR=f"127.0.0.1:{port}",
        DISTOPT_DDP_PORT=str(ddp_port),
    )  # fmt: skip
    config = str(ROOT / "configs" / "jobs" / "ps_dlrm_tiny.yaml")
    sets = [f"output_dir={tmp_path}", f"ps.start_timeout_s={_DEADLINE_S}"]
    proc = subprocess.run(
        [sys.executable, "-c", _ROLE_HARNESS, "--config", config,
         *[a for s in sets for a in ("--set", s)]],
        capture_output=True, text=True, timeout=120, env=env,
    )  # fmt: skip
    assert proc.returncode == 1, proc.stdout + proc.stderr
    elapsed = float(re.search(r"in ([\d.]+) s", proc.stdout).group(1))  # type: ignore[union-attr]
    assert elapsed < _DEADLINE_S + _SLACK_S
    assert proc.stderr.strip().splitlines() == [
        f"distopt.train: error: trainer1: RPC group store (hosted by ps0) at 127.0.0.1:{port} "
        f"unreachable after 1.5 s: [Errno 111] Connection refused"
    ], proc.stderr


def _gloo_trainer(plan: StorePlan, rank: int, results: Any) -> None:
    """One trainer process: host what the plan gives it, join the group, all-reduce ``rank + 1``."""
    me = f"trainer{rank}"
    os.environ.pop("GLOO_SOCKET_IFNAME", None)  # whatever the parent had: the plan decides
    with rendezvous.host_stores(plan, me=me, timeout_s=30.0) as hosted:
        rendezvous.init_gloo(hosted.plan, me=me, rank=rank, world_size=2, timeout_s=30.0)
        try:
            value = torch.tensor([float(rank + 1)])
            dist.all_reduce(value)
            results.put((rank, float(value.item()), os.environ.get("GLOO_SOCKET_IFNAME")))
        finally:
            dist.destroy_process_group()


@pytest.mark.slow
def test_two_trainer_processes_form_a_gloo_group() -> None:
    plan = StorePlan(host="127.0.0.1", hosted_by="trainer0", gloo_port=free_port())
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    procs = [context.Process(target=_gloo_trainer, args=(plan, r, results)) for r in (0, 1)]
    try:
        for proc in procs:
            proc.start()
        got = sorted(results.get(timeout=90) for _ in procs)
        for proc in procs:
            proc.join(timeout=30)
    finally:
        for proc in procs:
            if proc.is_alive() and proc.pid is not None:
                os.kill(proc.pid, 9)
                proc.join()
    assert [p.exitcode for p in procs] == [0, 0]
    assert got == [(0, 3.0, "lo"), (1, 3.0, "lo")]  # a loopback plan pins gloo to loopback


def _aborting_rank(rank: int) -> None:
    if rank == 1:
        os.abort()


def _peer_that_never_comes(rank: int) -> None:
    if rank == 0:
        time.sleep(3.0)
        return
    with rendezvous.collective("a step that needs rank 0"):
        dist.all_reduce(torch.ones(1))


def test_a_spawned_rank_that_aborts_names_itself(capfd: pytest.CaptureFixture[str]) -> None:
    """Issue 22 item 9: a spawned rank killed by SIGABRT is one line naming it, and its stack."""
    with pytest.raises(RemoteCallError) as info:
        rendezvous.run_spawned(_aborting_rank, world_size=2, what="bench", timeout_s=30.0)
    assert str(info.value) == (
        "bench: rank 1 terminated with signal SIGABRT (its stack, where Python "
        "could print one, is above)"
    )
    err = capfd.readouterr().err
    assert "Fatal Python error: Aborted" in err and "in _aborting_rank" in err, err[-2000:]


def test_a_collective_that_times_out_names_the_rank_and_the_step() -> None:
    """Issue 22 item 9: every distributed wait has a deadline (the group's timeout, here 1 s) and
    a one-line error naming the rank and what it waited for."""
    with pytest.raises(RemoteCallError) as info:
        rendezvous.run_spawned(_peer_that_never_comes, world_size=2, what="test", timeout_s=1.0)
    assert re.fullmatch(
        r"test: rank 1 failed: distopt\.errors\.RemoteCallError: rank 1: timed out waiting for the "
        r"other ranks in a step that needs rank 0: \[\S+\] Timed out waiting 1000ms for (recv|send) "
        r"operation to complete",
        str(info.value),
    ), str(info.value)
