"""A 2-rank gloo all-reduce for the multi-host tests; each rank prints one JSON line.

``env://`` rendezvous at ``MASTER_ADDR:MASTER_PORT``; the rank and world size come from torchrun
(``RANK``/``WORLD_SIZE``) or from Slurm (``SLURM_PROCID``/``SLURM_NTASKS``). The line says where
the rank ran: its hostname and the address its host sends from toward ``MASTER_ADDR``.
"""

from __future__ import annotations

import datetime
import json
import os
import socket

import torch
import torch.distributed as dist


def address_toward(host: str) -> str:
    """The local address the kernel picks to reach ``host`` (a UDP connect sends nothing)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.connect((host, 9))
        return str(sock.getsockname()[0])


def main() -> None:
    rank = int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", "-1")))
    world = int(os.environ.get("WORLD_SIZE", os.environ.get("SLURM_NTASKS", "0")))
    dist.init_process_group(
        "gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60)
    )
    value = torch.tensor([float(rank + 1)])
    dist.all_reduce(value)
    record = {
        "rank": rank,
        "sum": value.item(),
        "hostname": socket.gethostname(),
        "addr": address_toward(os.environ["MASTER_ADDR"]),
        "master_addr": os.environ["MASTER_ADDR"],
        "gloo_ifname": os.environ.get("GLOO_SOCKET_IFNAME"),
    }
    dist.destroy_process_group()
    print(json.dumps(record), flush=True)


if __name__ == "__main__":
    main()
