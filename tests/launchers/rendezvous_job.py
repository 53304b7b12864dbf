"""A stand-in for ``distopt.train`` that follows the same launch contract, for launcher tests.

``python -m tests.launchers.rendezvous_job --config PATH [--set key=value ...]``: the ``ps`` and
``trainer`` replicas rendezvous over ``torch.distributed.rpc`` at ``MASTER_ADDR:MASTER_PORT``
(through :mod:`distopt.dist.rendezvous`, with the plan of ``distopt.train``'s roles);
trainers push a value to the server by RPC and all-reduce among themselves in a gloo group whose
store the first server hosts on ``DISTOPT_DDP_PORT``. Each replica writes one JSON line to
``<output_dir>/<role>-<replica>.jsonl`` (config keys: ``output_dir``, ``fail_trainer``: the
trainer replica that exits with code 3 after the rendezvous, -1 for none).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.rpc as rpc
import yaml

from distopt.dist import rendezvous
from distopt.ps.spec import ServerOptions

# Meeting is generous: on a loaded CI host three replicas importing torch may take a while to
# start. Shutting down is short: there a crashed peer must fail the job quickly, never hang it.
TIMEOUT_S = 45
SHUTDOWN_TIMEOUT_S = 10
_received: list[float] = []


def push(value: float) -> float:
    """Runs on the server: record a trainer's value and echo it back."""
    _received.append(value)
    return value


def _config(argv: list[str]) -> dict:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", required=True)
    parser.add_argument("--set", action="append", default=[])
    args = parser.parse_args(argv)
    config = yaml.safe_load(Path(args.config).read_text()) or {}
    for item in args.set:
        key, _, raw = item.partition("=")
        config[key] = yaml.safe_load(raw)
    return config


def main(argv: list[str]) -> int:
    config = _config(argv)
    role = os.environ["DISTOPT_ROLE"]
    replica = int(os.environ["REPLICA_ID"])
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    num_ps, num_trainers = (
        int(os.environ["DISTOPT_NUM_PS"]),
        int(os.environ["DISTOPT_NUM_TRAINERS"]),
    )
    addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    assert os.environ["DISTOPT_PS_ADDR"] == f"{addr}:{port}"
    assert world == num_ps + num_trainers and rank == (
        replica if role == "ps" else num_ps + replica
    )
    started = time.time()

    # The first server hosts the RPC store and the trainers' gloo store on MASTER_ADDR only (a plain
    # TCPStore server would listen on every interface), as distopt.train's ps role does.
    plan = rendezvous.StorePlan(
        host=addr, hosted_by="ps0", rpc_port=port, gloo_port=int(os.environ["DISTOPT_DDP_PORT"])
    )
    me = f"{role}{replica}"
    total: float | None = None
    members = [f"ps{i}" for i in range(num_ps)] + [f"trainer{i}" for i in range(num_trainers)]
    with rendezvous.host_stores(plan, me=me, timeout_s=TIMEOUT_S):
        others = [m for m in members if m != me]
        rendezvous.meet(plan, me=me, others=others, timeout_s=TIMEOUT_S)
        rendezvous.init_rpc(
            plan, name=me, rank=rank, world_size=world, transport=ServerOptions(host=addr),
            timeout_s=TIMEOUT_S,
        )  # fmt: skip
        if role == "trainer":
            if replica == config.get("fail_trainer", -1):
                print(f"trainer {replica}: failing on purpose", flush=True)
                os._exit(3)
            echoed = rpc.rpc_sync("ps0", push, args=(float(replica + 1),))
            rendezvous.init_gloo(
                plan, me=me, rank=replica, world_size=num_trainers, timeout_s=TIMEOUT_S
            )
            tensor = torch.tensor([echoed])
            dist.all_reduce(tensor)
            total = float(tensor.item())
            dist.destroy_process_group()
        # A bounded shutdown: a crashed peer must fail this replica, not hang it. The store host
        # leaves the with block (closing the stores) only after this barrier.
        rpc.shutdown(graceful=True, timeout=SHUTDOWN_TIMEOUT_S)
    out = Path(config.get("output_dir", "out"))
    out.mkdir(parents=True, exist_ok=True)
    record = {
        "role": role, "replica": replica, "rank": rank, "world_size": world,
        "allreduce": total, "received": sorted(_received), "seconds": time.time() - started,
    }  # fmt: skip
    (out / f"{role}-{replica}.jsonl").write_text(json.dumps(record) + "\n")
    print(f"{role} {replica}: ok {record}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
