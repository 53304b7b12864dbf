"""The trainers' gloo process group: rendezvous on loopback unless the launcher says otherwise."""

from __future__ import annotations

import datetime
import ipaddress
import os
import socket

import torch.distributed as dist

from distopt.errors import ConfigError
from distopt.job.env import JobEnv


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _bound_store(host: str, port: int, env: JobEnv, timeout: datetime.timedelta) -> dist.Store:
    """The rendezvous store, its server socket bound to ``host`` only.

    ``TCPStore`` binds its server to every interface whatever host it is given; handing it a
    socket we bound ourselves (``master_listen_fd``) keeps the store on the rendezvous address
    (loopback for a single-host job, the cluster network's address otherwise).
    """
    if env.rank != 0:
        return dist.TCPStore(host, port, env.num_trainers, False, timeout=timeout)
    address = "127.0.0.1" if host == "localhost" else host
    sock = socket.socket(socket.AF_INET6 if ":" in address else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((address, port))
    sock.listen(256)
    return dist.TCPStore(
        host,
        sock.getsockname()[1],
        env.num_trainers,
        True,
        timeout=timeout,
        master_listen_fd=sock.detach(),  # the store owns the socket from now on
        use_libuv=True,
    )


def init_trainer_group(env: JobEnv, *, timeout_s: float = 120.0) -> None:
    """Join the gloo group of all trainers (``env.num_trainers`` ranks).

    Under torchrun the agent's store is reused (``env://``). Otherwise trainer 0 serves the
    rendezvous store on ``MASTER_ADDR:MASTER_PORT`` only (a free loopback port for a lone trainer).
    On a loopback rendezvous gloo is pinned to loopback too; otherwise gloo would bind the
    address the hostname resolves to. torchrun's own agent store listens on every interface: that
    is torchrun's doing, not ours.
    """
    if dist.is_initialized():
        return
    timeout = datetime.timedelta(seconds=timeout_s)
    host, port = env.master_addr, env.master_port
    if host is None or port is None:
        if env.num_trainers > 1:
            raise ConfigError(
                f"environment MASTER_ADDR/MASTER_PORT: required for {env.num_trainers} trainers "
                "(launch with torchrun or TorchX)"
            )
        host, port = "127.0.0.1", 0
    if is_loopback(host):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        dist.init_process_group(
            "gloo",
            init_method="env://",
            rank=env.rank,
            world_size=env.num_trainers,
            timeout=timeout,
        )
        return
    store = _bound_store(host, port, env, timeout)
    dist.init_process_group(
        "gloo", store=store, rank=env.rank, world_size=env.num_trainers, timeout=timeout
    )


def shutdown_trainer_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
