"""What a ``distopt.train`` job with parameter servers is made of, read from its config and the
environment TorchX set: the server options, the store plan and the model's tables.

Used by both kinds of trainer (:mod:`distopt.roles.ps_roles`, :mod:`distopt.roles.ray_roles`) and by
the ``ps`` role that serves the tables.
"""

from __future__ import annotations

import dataclasses

import torch

from distopt import models
from distopt.dist import netif
from distopt.dist.env import JobEnv
from distopt.dist.rendezvous import StorePlan
from distopt.errors import ConfigError
from distopt.ps.spec import ServerOptions, TableSpec, server_name
from distopt.training.config import JobConfig


def server_options(config: JobConfig, env: JobEnv) -> ServerOptions:
    """The config's ``ps`` options with the launcher's server count, host and interface (the
    environment's ``TP_SOCKET_IFNAME``/``GLOO_SOCKET_IFNAME`` over ``ps.interface``)."""
    assert env.ps_addr is not None
    host = env.ps_addr[0]
    interface = netif.from_environ() or config.ps.interface
    return dataclasses.replace(
        config.ps,
        num_servers=env.num_ps,
        host="127.0.0.1" if host == "localhost" else host,
        interface=interface,
    )


def store_plan(env: JobEnv, options: ServerOptions) -> StorePlan:
    """Server 0 hosts the RPC group's store and, when the launcher gave a port, the trainers'."""
    assert env.ps_addr is not None
    return StorePlan(
        host=options.host, hosted_by=server_name(0), rpc_port=env.ps_addr[1], gloo_port=env.ddp_port
    )


def job_tables(config: JobConfig) -> tuple[TableSpec, ...]:
    """The parameter-server tables of the job's model (its ``ps_tables()``)."""
    torch.manual_seed(config.seed)
    model = models.build(config.model_name, **config.model_kwargs)
    ps_tables = getattr(model, "ps_tables", None)
    if not callable(ps_tables):
        raise ConfigError(
            f"model: {config.model_name!r} has no ps_tables() method, so it cannot run with "
            "parameter servers (launch it with ddp or without servers)"
        )
    return tuple(ps_tables())
