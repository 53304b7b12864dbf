"""The corpus's RPC group on 127.0.0.1: this process as ``trainer0`` (rank 0, the name distopt.ps gives it too: a process keeps one RPC identity for dist_autograd) and servers ``ps0..``.

This process hosts the group's store (a socket bound to 127.0.0.1 only) and outlives the
servers, which it starts as subprocesses and reaps by PID however the block ends.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed.rpc as rpc

from distopt.dist import rendezvous
from distopt.ps.spec import ServerOptions
from tests.remote.corpus import tables

REPO = Path(__file__).resolve().parents[3]
START_TIMEOUT_S = 60.0


def _check_rrefs_reach(server: str) -> None:
    # PyTorch binds the RRef context to the first RPC agent that used RRefs in a process
    # (a leaky singleton in rref_context.cpp) and keeps it across shutdown and re-init.
    try:
        rpc.remote(server, torch.add, args=(torch.zeros(1), 0)).owner()
    except RuntimeError as error:
        if "could not find destination" not in str(error):
            raise
        raise RuntimeError(
            f"RRefs cannot reach {server} in this process ({error}): an earlier RPC group of "
            "another size used RRefs here; run tests/remote in its own pytest process "
            "(make test does)"
        ) from None


@contextlib.contextmanager
def rpc_group(num_servers: int = 2, *, latency_ms: float = 0.0) -> Iterator[list[str]]:
    """Form the group; yields the server names. Every request to a server first sleeps
    ``latency_ms`` there (network and server time)."""
    world = num_servers + 1
    plan = rendezvous.StorePlan(host="127.0.0.1", hosted_by="trainer0", rpc_port=0)
    names = [f"ps{i}" for i in range(num_servers)]
    with rendezvous.host_stores(plan, me="trainer0", timeout_s=START_TIMEOUT_S) as hosted:
        plan_json = json.dumps(dataclasses.asdict(hosted.plan))
        procs = [
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "tests.remote.corpus.server",
                    plan_json,
                    name,
                    str(rank),
                    str(world),
                    str(latency_ms),
                ],
                cwd=REPO,
            )  # fmt: skip
            for rank, name in enumerate(names, start=1)
        ]
        try:
            rendezvous.meet(hosted.plan, me="trainer0", others=names, timeout_s=START_TIMEOUT_S)
            rendezvous.init_rpc(
                hosted.plan, name="trainer0", rank=0, world_size=world, transport=ServerOptions(),
                timeout_s=START_TIMEOUT_S,
            )  # fmt: skip
            try:
                _check_rrefs_reach(names[-1])
                yield names
            finally:
                stops = [rpc.rpc_async(name, tables.stop_server) for name in names]
                for stop in stops:
                    with contextlib.suppress(RuntimeError):
                        stop.wait()
                # Together with the servers (every agent shutting down before a pipe closes), once
                # the RRefs this process dropped have reached their owners.
                gc.collect()
                rendezvous.leave_rpc(me="trainer0", graceful=True)
            for proc in procs:
                proc.wait(timeout=60)
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
