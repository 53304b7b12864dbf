"""The roles of a ``distopt.train`` job with parameter servers: ``ps`` serves tables, ``trainer``
trains against them.

The same job as :mod:`distopt.ps.launch`, launched by TorchX (``ps_job``) or ``distopt.supervise``
instead of by a Python process: one RPC group holds trainers ``trainer0..`` (RPC ranks ``0..T-1``)
and servers ``ps0..ps{S-1}`` (ranks ``T..T+S-1``). With no launching process to outlive the job,
server 0 hosts both rendezvous stores (:func:`store_plan`): the RPC group's at
``DISTOPT_PS_ADDR`` and the trainers' gloo group's at ``DISTOPT_DDP_PORT`` on that host, each on a
socket bound to that host only. Servers shut down as in :mod:`distopt.ps.launch`: each exits once
every trainer has said it is done, server 0 keeps the stores until every trainer has left; a
trainer that fails aborts the servers (exit status 1), so the job fails at once instead of
waiting for ``ps.trainer_timeout_s``.

With ``ps.backend: ray`` there are no ``ps`` processes: trainer 0 creates the servers as Ray
actors and the trainers form no RPC group (:mod:`distopt.job.ray_roles`). The training loop, its
pushes and its checkpoints are the same on both backends (:func:`train_with_servers`).

The tables come from the model: the model built from the job config must have a
``ps_tables() -> Sequence[TableSpec]`` method. Servers build the model only to ask it (models whose
embeddings live on the servers hold no large parameters, and building one makes no RPC).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from distopt import models
from distopt.errors import ConfigError
from distopt.job.config import JobConfig
from distopt.job.env import JobEnv
from distopt.job.logs import record_failure
from distopt.ps.spec import ServerOptions, TableSpec, check_tables, server_name
from distopt.rendezvous import StorePlan

if TYPE_CHECKING:
    from distopt.job.trainer import TrainResult


def server_options(config: JobConfig, env: JobEnv) -> ServerOptions:
    """The config's ``ps`` options with the launcher's server count, host and interface."""
    assert env.ps_addr is not None
    host = env.ps_addr[0]
    interface = os.environ.get("TP_SOCKET_IFNAME") or config.ps.interface
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


def serve(config: JobConfig, env: JobEnv) -> int:
    """Run parameter server ``env.rank`` until every trainer has finished."""
    from distopt.ps import server

    options = server_options(config, env)
    if options.backend != "rpc":
        raise ConfigError(f"ps.backend: {options.backend!r} jobs have no ps processes (trainer 0 "
                          f"creates the server actors), yet this is ps {env.rank}: launch the job "
                          "with distopt.ps_job or distopt launch")  # fmt: skip
    tables = job_tables(config)
    check_tables(tables, options.num_servers)
    plan = store_plan(env, options)
    print(
        f"[ps {env.rank}] serving {len(tables)} tables for {env.num_trainers} trainers "
        f"(RPC group at {plan.host}:{plan.rpc_port})",
        flush=True,
    )
    server.serve(
        {
            "index": env.rank,
            "rank": env.num_trainers + env.rank,  # RPC ranks: trainers first, then servers
            "world_size": options.num_servers + env.num_trainers,
            "plan": dataclasses.asdict(plan),
            "options": dataclasses.asdict(options),
            "tables": [dataclasses.asdict(t) for t in tables],
        }
    )
    print(f"[ps {env.rank}] all trainers finished", flush=True)
    return 0


def train_with_servers(config: JobConfig, env: JobEnv) -> int:
    """Trainer ``env.rank``: join the servers (and the gloo group), train, push after backward."""
    options = server_options(config, env)
    needs_gloo = env.num_trainers > 1 or config.parallel != "none"
    if options.backend == "ray":
        from distopt.job.ray_roles import actor_servers

        servers = actor_servers(config, env, options, gloo=needs_gloo)
    else:
        servers = _rpc_servers(env, options, gloo=needs_gloo)
    with servers:
        result = _train(config, env, options)
    if env.rank == 0:
        print(f"run {result.run_id}: {result.steps} steps, QPS log {result.log_path}", flush=True)
    return 0


@contextlib.contextmanager
def _rpc_servers(env: JobEnv, options: ServerOptions, *, gloo: bool) -> Iterator[None]:
    """Join the RPC group of the ``ps`` processes (and the gloo group) for the ``with`` block;
    leave it at the end, or abort the servers when the block fails."""
    import distopt.ps as ps

    if gloo and env.ddp_port is None:
        raise ConfigError(
            f"environment DISTOPT_DDP_PORT: required for {env.num_trainers} trainers or DDP "
            "in a job with parameter servers"
        )
    job = ps.PSJob(plan=store_plan(env, options), num_trainers=env.num_trainers, options=options)
    ps.init_trainer(job, rank=env.rank, ddp=gloo)
    try:
        yield
    except BaseException as err:
        record_failure(err)
        ps.abort(f"trainer {env.rank} failed: {type(err).__name__}: {err}")
        raise
    ps.shutdown()


def _train(config: JobConfig, env: JobEnv, options: ServerOptions) -> TrainResult:
    """The training loop of a trainer joined to its servers, whatever their backend."""
    import distopt.ps as ps
    from distopt.job import recovery
    from distopt.job.trainer import Hooks, train

    # Ray actors restarted by Ray: every trainer rolls back to the last checkpoint together.
    agreement = recovery.Agreement.for_job(options)

    def push(_model: torch.nn.Module) -> None:
        if not config.deterministic:
            # Async: the pushes overlap the optimizer step and the next step's start; a
            # table's next fetch is ordered after its push by the client.
            ps.push_gradients(lr=config.lr)
            return
        # One trainer at a time, in rank order, each push applied before the next trainer's:
        # the servers sum the same updates in the same order on every run.
        # The barriers are the job's agreement points when it can recover (distopt.job.recovery).
        for turn in range(env.num_trainers):
            if turn == env.rank:
                with agreement.deferred():
                    ps.push_gradients(lr=config.lr, blocking=True)
            agreement.barrier()

    def save_remote(path: Path) -> None:
        # Absolute: a Ray actor's working directory is not the trainer's.
        ps.save_servers(str(path.resolve()))  # every trainer's pushes drained: see distopt.job.state

    def load_remote(path: Path) -> None:
        ps.load_servers(str(path.resolve()))

    hooks = Hooks(
        # distopt.optimize's verification fetched rows (and may have backpropagated into
        # them); they belong to no training step and must not be pushed.
        before_loop=ps.discard_step,
        after_backward=push,
        before_checkpoint=ps.flush,
        save_remote=save_remote,
        load_remote=load_remote,
        recover=lambda found: recovery.recover_servers(agreement, found),
    )
    header = {"ps_latency_ms": options.latency_ms}
    return recovery.retrying(lambda: train(config, env, hooks=hooks, header_extra=header, agreement=agreement),
                             agreement)  # fmt: skip


def run_ps_role(config: JobConfig, env: JobEnv) -> int:
    """Entry of every process of a job with parameter servers."""
    return serve(config, env) if env.role == "ps" else train_with_servers(config, env)
