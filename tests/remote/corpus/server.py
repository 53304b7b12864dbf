"""A plain ``torch.distributed.rpc`` worker: joins the group, serves until everyone shuts down.

``python -m tests.remote.corpus.server PLAN_JSON NAME RANK WORLD LATENCY_MS`` (started by
:mod:`tests.remote.corpus.group`). It holds whatever the trainer creates on it through
``rpc.remote``/``RemoteModule``/``create_table`` (see :mod:`tests.remote.corpus.tables`).
"""

from __future__ import annotations

import json
import sys

from distopt.dist import rendezvous
from distopt.ps.spec import ServerOptions
from tests.remote.corpus import tables

START_TIMEOUT_S = 60.0


def main(argv: list[str]) -> int:
    plan_json, name, rank, world, latency_ms = argv
    plan = rendezvous.StorePlan(**json.loads(plan_json))
    tables.LATENCY_S = float(latency_ms) / 1000.0
    others = [f"ps{i}" for i in range(int(world) - 1) if f"ps{i}" != name] + ["trainer0"]
    rendezvous.meet(plan, me=name, others=others, timeout_s=START_TIMEOUT_S)
    rendezvous.init_rpc(
        plan, name=name, rank=int(rank), world_size=int(world), transport=ServerOptions(),
        timeout_s=START_TIMEOUT_S,
    )  # fmt: skip
    tables.STOP.wait()  # serve until the trainer says stop
    rendezvous.leave_rpc(me=name, graceful=True)  # together with the trainer and the others
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
