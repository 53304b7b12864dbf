"""The gloo process group of a trainers-only job (DDP/FSDP under torchrun, TorchX or alone)."""

from __future__ import annotations

import contextlib
import datetime
import os
from collections.abc import Iterator

import torch.distributed as dist

from distopt.dist import netif, rendezvous
from distopt.errors import ConfigError
from distopt.dist.env import JobEnv
from distopt.ps.spec import trainer_name
from distopt.dist.rendezvous import StorePlan


def store_plan(env: JobEnv) -> StorePlan:
    """Trainer 0 hosts the gloo group's store on ``MASTER_ADDR:MASTER_PORT`` (a lone trainer: a
    free loopback port)."""
    host, port = env.master_addr, env.master_port
    if host is None or port is None:
        if env.num_trainers > 1:
            raise ConfigError(
                f"environment MASTER_ADDR/MASTER_PORT: required for {env.num_trainers} trainers "
                "(launch with torchrun or TorchX)"
            )
        host, port = "127.0.0.1", 0
    return StorePlan(host=host, hosted_by=trainer_name(0), gloo_port=port)


@contextlib.contextmanager
def trainer_group(env: JobEnv, *, timeout_s: float = 120.0) -> Iterator[tuple[str, ...]]:
    """The gloo group of all trainers (``env.num_trainers`` ranks) as the default process group;
    yields each rank's host name (gathered once it forms), for errors that name a peer's host.

    Under torchrun the agent's store is reused (``env://``): torchrun's agent store listens on
    every interface, which is torchrun's doing, not ours. Otherwise the rendezvous follows
    :func:`store_plan` through :mod:`distopt.dist.rendezvous`, so the store listens on ``MASTER_ADDR``
    only. Either way gloo listens on the interface of the route toward ``MASTER_ADDR``, loopback
    for a job on one host, unless ``GLOO_SOCKET_IFNAME`` names one (:mod:`distopt.dist.netif`).
    """
    if dist.is_initialized():  # the caller formed it and will destroy it
        yield _hosts()
        return
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        netif.pin_gloo(env.master_addr or "127.0.0.1")
        dist.init_process_group(
            "gloo",
            init_method="env://",
            rank=env.rank,
            world_size=env.num_trainers,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
        try:
            yield _hosts()
        finally:
            rendezvous.leave_gloo()
        return
    me = trainer_name(env.rank)
    with rendezvous.host_stores(store_plan(env), me=me, timeout_s=timeout_s) as hosted:
        rendezvous.init_gloo(
            hosted.plan, me=me, rank=env.rank, world_size=env.num_trainers, timeout_s=timeout_s
        )
        try:
            yield _hosts()
        finally:
            rendezvous.leave_gloo()


def _hosts() -> tuple[str, ...]:
    """Every rank's host name, in rank order (one small all-gather)."""
    hosts: list[str | None] = [None] * dist.get_world_size()
    with rendezvous.collective("gathering the trainers' host names"):
        dist.all_gather_object(hosts, netif.hostname())
    return tuple(str(h) for h in hosts)
