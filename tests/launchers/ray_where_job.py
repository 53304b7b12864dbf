"""A Ray driver for the multi-host tests: an actor pinned to the node at ``argv[1]`` says where
it runs. Prints one JSON line: the driver's hostname and address, and the actor's."""

from __future__ import annotations

import json
import socket
import sys

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy


@ray.remote(num_cpus=0.1)
class Where:
    def where(self) -> dict[str, str]:
        return {"hostname": socket.gethostname(), "addr": ray.util.get_node_ip_address()}


def main(target_addr: str) -> None:
    ray.init(log_to_driver=False)  # the job's cluster (RAY_ADDRESS, set by the job supervisor)
    nodes = [n for n in ray.nodes() if n["Alive"] and n["NodeManagerAddress"] == target_addr]
    if not nodes:
        sys.exit(
            f"no live Ray node at {target_addr}: {[n['NodeManagerAddress'] for n in ray.nodes()]}"
        )
    pin = NodeAffinitySchedulingStrategy(node_id=nodes[0]["NodeID"], soft=False)
    actor = Where.options(scheduling_strategy=pin).remote()
    record = {
        "driver": {"hostname": socket.gethostname(), "addr": ray.util.get_node_ip_address()},
        "actor": ray.get(actor.where.remote(), timeout=60),
    }
    print(json.dumps(record), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
