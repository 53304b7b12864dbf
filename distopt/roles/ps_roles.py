"""The roles of a ``distopt.train`` job with parameter servers: ``ps`` serves tables, ``trainer``
trains against them.

The same job as :mod:`distopt.ps.cluster.rpc_backend` starts from Python, launched by TorchX (``ps_job``)
or ``distopt.roles.supervise`` instead: one RPC group holds trainers ``trainer0..`` (RPC ranks
``0..T-1``) and servers ``ps0..ps{S-1}`` (ranks ``T..T+S-1``). With no launching process to
outlive the job, server 0 hosts both rendezvous stores (:func:`~distopt.roles.ps_setup.store_plan`):
the RPC group's at ``DISTOPT_PS_ADDR`` and the trainers' gloo group's at ``DISTOPT_DDP_PORT`` on
that host, each on a socket bound to that host only. Servers shut down as every RPC job's do: each
exits once every trainer has said it is done, server 0 keeps the stores until every trainer has
left; a trainer that fails aborts the servers (exit status 1), so the job fails at once instead
of waiting for ``ps.trainer_timeout_s``.

With ``ps.backend: ray`` there are no ``ps`` processes: trainer 0 creates the servers as Ray
actors and the trainers form no RPC group (:mod:`distopt.roles.ray_roles`). How a trainer joins its
servers is the one thing that differs (:data:`JOIN_SERVERS`); the training loop, its pushes and
its checkpoints are the same on both backends (:func:`train_with_servers`).

The tables come from the model: the model built from the job config must have a
``ps_tables() -> Sequence[TableSpec]`` method. Servers build the model only to ask it (models whose
embeddings live on the servers hold no large parameters, and building one makes no RPC).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

import distopt.ps as ps
from distopt.dist.env import JobEnv
from distopt.errors import ConfigError
from distopt.ps.cluster import rpc_process
from distopt.ps.cluster.session import backend_for
from distopt.ps.spec import ServerOptions, check_tables
from distopt.roles.ps_setup import job_tables, server_options, store_plan
from distopt.roles.ray_roles import actor_servers
from distopt.training import recovery
from distopt.training.config import JobConfig
from distopt.training.logs import record_failure
from distopt.training.trainer import Hooks, TrainResult, train


def serve(config: JobConfig, env: JobEnv) -> int:
    """Run parameter server ``env.rank`` until every trainer has finished."""
    options = server_options(config, env)
    if not backend_for(options).runs_server_processes:
        raise ConfigError(
            f"ps.backend: {options.backend!r} jobs have no ps processes (trainer 0 creates the "
            f"server actors), yet this is ps {env.rank}: launch the job with distopt.ps_job or "
            "distopt launch"
        )
    tables = job_tables(config)
    check_tables(tables, options.num_servers)
    plan = store_plan(env, options)
    print(
        f"[ps {env.rank}] serving {len(tables)} tables for {env.num_trainers} trainers "
        f"(RPC group at {plan.host}:{plan.rpc_port})",
        flush=True,
    )
    rpc_process.serve(
        rpc_process.config(
            index=env.rank,
            num_trainers=env.num_trainers,
            plan=plan,
            options=options,
            tables=tables,
        )
    )
    print(f"[ps {env.rank}] all trainers finished", flush=True)
    return 0


@contextlib.contextmanager
def rpc_servers(
    config: JobConfig, env: JobEnv, options: ServerOptions, *, gloo: bool
) -> Iterator[None]:
    """Join the RPC group of the ``ps`` processes (and the gloo group) for the ``with`` block;
    leave it at the end, or abort the servers when the block fails."""
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


JoinServers = Callable[..., contextlib.AbstractContextManager[None]]

JOIN_SERVERS: dict[str, JoinServers] = {"rpc": rpc_servers, "ray": actor_servers}
"""How a trainer joins its job's servers for the ``with`` block, by ``ps.backend``: called as
``join(config, env, options, gloo=...)``."""


def train_with_servers(config: JobConfig, env: JobEnv) -> int:
    """Trainer ``env.rank``: join the servers (and the gloo group), train, push after backward."""
    options = server_options(config, env)
    needs_gloo = env.num_trainers > 1 or config.parallel != "none"
    with JOIN_SERVERS[options.backend](config, env, options, gloo=needs_gloo):
        result = _train(config, env, options)
    if env.rank == 0:
        print(f"run {result.run_id}: {result.steps} steps, QPS log {result.log_path}", flush=True)
    return 0


def _train(config: JobConfig, env: JobEnv, options: ServerOptions) -> TrainResult:
    """The training loop of a trainer joined to its servers, whatever their backend."""
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
        # The barriers are the job's agreement points when it can recover (distopt.training.recovery).
        for turn in range(env.num_trainers):
            if turn == env.rank:
                with agreement.deferred():
                    ps.push_gradients(lr=config.lr, blocking=True)
            agreement.barrier()

    def save_remote(path: Path) -> None:
        # Absolute: a Ray actor's working directory is not the trainer's.
        ps.save_servers(
            str(path.resolve())
        )  # every trainer's pushes drained: see distopt.training.state

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
    return recovery.retrying(
        lambda: train(config, env, hooks=hooks, header_extra=header, agreement=agreement), agreement
    )


def run_ps_role(config: JobConfig, env: JobEnv) -> int:
    """Entry of every process of a job with parameter servers."""
    return serve(config, env) if env.role == "ps" else train_with_servers(config, env)
