"""Faults with real processes: unreachable servers, a server killed mid-step."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch

import distopt.ps as ps
from distopt.dist.rendezvous import StorePlan
from distopt.errors import RemoteCallError
from distopt.ps import PSJob, stop_servers
from distopt.ps.cluster.job import LAUNCHER
from distopt.ps.spec import ServerOptions, TableSpec
from tests.conftest import free_port

pytestmark = pytest.mark.slow

TABLES = (TableSpec(name="t", num_rows=10, dim=4),)


def test_unreachable_job_store_fails_within_start_timeout() -> None:
    port = free_port()  # nothing listens there
    plan = StorePlan(host="127.0.0.1", hosted_by=LAUNCHER, rpc_port=port)
    job = PSJob(plan=plan, num_trainers=1, options=ServerOptions(start_timeout_s=1.5))
    start = time.monotonic()
    with pytest.raises(RemoteCallError, match=f"127.0.0.1:{port} unreachable after 1.5 s"):
        ps.init_trainer(job)
    assert time.monotonic() - start < 1.5 + 1.0  # our deadline, not TCPStore's retry back-off


def test_servers_that_never_join_are_named_within_start_timeout() -> None:
    options = ServerOptions(num_servers=2, start_timeout_s=2.0)
    with ps.running_servers(TABLES, options, stop_timeout_s=1.0) as job:
        for pid in job.pids:  # servers die before the trainer arrives
            os.kill(pid, signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(
            RemoteCallError, match=r"trainer0: ps0, ps1 did not join .* within 2 s.*exited with -9"
        ):
            ps.init_trainer(job)
        assert time.monotonic() - start < 2.0 + 3.0


def test_server_killed_mid_step_fails_the_wait_naming_it() -> None:
    options = ServerOptions(num_servers=2, latency_ms=500, rpc_timeout_s=5.0, start_timeout_s=20)
    with ps.running_servers(TABLES, options, stop_timeout_s=1.0) as job:
        ps.init_trainer(job)
        try:
            fut = ps.fetch_async("t", torch.arange(10))  # both shards, 500 ms each
            os.kill(job.pids[1], signal.SIGKILL)
            start = time.monotonic()
            with pytest.raises(RemoteCallError, match="fetch of 't' on ps1 failed"):
                ps.wait(fut)
            assert time.monotonic() - start < options.rpc_timeout_s
            with pytest.raises(RemoteCallError, match="on ps1 failed"):  # later calls fail too
                ps.fetch("t", torch.tensor([1]))
        finally:
            ps.shutdown(graceful=False)
        codes = stop_servers(job, timeout_s=0.5)
    assert codes[1] == -signal.SIGKILL
