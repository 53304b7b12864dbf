"""Jobs with parameter servers: the ``ps`` role serves tables, the trainer role trains against them.

One RPC group holds trainers ``trainer0..`` (RPC ranks ``0..T-1``) and servers ``ps0..ps{S-1}``
(ranks ``T..T+S-1``), the ranking of :mod:`distopt.ps.launch`.
Server 0 hosts two rendezvous stores on the ``DISTOPT_PS_ADDR`` host, each on a socket bound to
that host only (a loopback job listens on loopback only): the RPC group's at ``DISTOPT_PS_ADDR``
and the trainers' gloo group's at ``DISTOPT_DDP_PORT``; every other process is a store client.
Servers serve until every trainer has left the RPC group (a graceful ``rpc.shutdown`` is the serve
loop); server 0 keeps the stores up until each trainer has reported it is done. A trainer that
fails with an exception asks every server to exit with status 1, so the job fails at once instead
of waiting for ``ps.join_timeout_s``.

The tables come from the model: the model built from the job config must have a
``ps_tables() -> Sequence[TableSpec]`` method. Servers build the model only to ask it (models whose
embeddings live on the servers hold no large parameters, and building one makes no RPC).
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import sys
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

from distopt import models
from distopt.errors import ConfigError
from distopt.job.config import JobConfig
from distopt.job.dist import is_loopback
from distopt.job.env import JobEnv
from distopt.job.state import barrier
from distopt.ps.spec import ServerOptions, TableSpec, check_tables

_FINISHED_KEY = "distopt/trainers_finished"


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
    from distopt import rendezvous
    from distopt.ps import server

    options = server_options(config, env)
    tables = job_tables(config)
    check_tables(tables, options.num_servers)
    assert env.ps_addr is not None
    host, port = env.ps_addr
    stores = []
    if env.rank == 0:
        try:
            stores.append(rendezvous.host_store(host, port, options.join_timeout_s))
            if env.ddp_port is not None:
                stores.append(rendezvous.host_store(host, env.ddp_port, options.join_timeout_s))
        except OSError as err:
            raise ConfigError(
                f"ps 0: cannot serve the rendezvous stores on {host} ({err})"
            ) from None
    print(
        f"[ps {env.rank}] serving {len(tables)} tables for {env.num_trainers} trainers "
        f"(RPC group at {host}:{port})",
        flush=True,
    )
    server.serve(
        {
            "index": env.rank,
            "rank": env.num_trainers + env.rank,  # RPC ranks: trainers first, then servers
            "world_size": options.num_servers + env.num_trainers,
            "port": port,
            "options": dataclasses.asdict(options),
            "tables": [dataclasses.asdict(t) for t in tables],
        }
    )
    if stores:
        # Trainers still talk to the store while they leave the RPC group: keep it up until each
        # has said it is done (bounded, in case one died after the shutdown barrier).
        deadline = time.monotonic() + options.rpc_timeout_s
        while stores[0].add(_FINISHED_KEY, 0) < env.num_trainers and time.monotonic() < deadline:
            time.sleep(0.05)
    print(f"[ps {env.rank}] all trainers finished", flush=True)
    return 0


def _finished(env: JobEnv, options: ServerOptions) -> None:
    """Tell server 0 this trainer has left the RPC group (so it may close the store)."""
    assert env.ps_addr is not None
    host, port = env.ps_addr
    store = dist.TCPStore(
        host,
        port,
        None,
        False,
        timeout=datetime.timedelta(seconds=options.rpc_timeout_s),
        wait_for_workers=False,
    )
    store.add(_FINISHED_KEY, 1)


def _init_trainer_gloo(env: JobEnv, options: ServerOptions) -> None:
    """Join the trainers' gloo group through the store server 0 hosts at ``DISTOPT_DDP_PORT``."""
    if env.ddp_port is None:
        raise ConfigError(
            f"environment DISTOPT_DDP_PORT: required for {env.num_trainers} trainers or DDP "
            "in a job with parameter servers"
        )
    assert env.ps_addr is not None
    host = env.ps_addr[0]
    if is_loopback(host):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    timeout = datetime.timedelta(seconds=options.start_timeout_s)
    store = dist.TCPStore(host, env.ddp_port, env.num_trainers, False, timeout=timeout)
    dist.init_process_group(
        "gloo", store=store, rank=env.rank, world_size=env.num_trainers, timeout=timeout
    )


def train_with_servers(config: JobConfig, env: JobEnv) -> int:
    """Trainer ``env.rank``: join the RPC group (and the gloo group), train, push after backward."""
    import distopt.ps as ps
    from distopt.job.trainer import Hooks, train

    options = server_options(config, env)
    assert env.ps_addr is not None
    job = ps.PSJob(
        host=options.host, port=env.ps_addr[1], num_trainers=env.num_trainers, options=options
    )
    ps.init_trainer(job, rank=env.rank, ddp=False)
    ok = False
    try:
        if env.num_trainers > 1 or config.parallel != "none":
            _init_trainer_gloo(env, options)

        def push(_model: torch.nn.Module) -> None:
            if not config.deterministic:
                # Async: the pushes overlap the optimizer step and the next step's start; a
                # table's next fetch is ordered after its push by the client.
                ps.push_gradients(lr=config.lr)
                return
            # One trainer at a time, in rank order, each push applied before the next trainer's:
            # the servers sum the same updates in the same order on every run.
            for turn in range(env.num_trainers):
                if turn == env.rank:
                    ps.push_gradients(lr=config.lr, blocking=True)
                barrier()

        def save_remote(path: Path) -> None:
            ps.save_servers(str(path))  # every trainer's pushes drained: see distopt.job.state

        def load_remote(path: Path) -> None:
            ps.load_servers(str(path))

        hooks = Hooks(
            # distopt.optimize's verification fetched rows (and may have backpropagated into
            # them); they belong to no training step and must not be pushed.
            before_loop=ps.discard_step,
            after_backward=push,
            before_checkpoint=ps.flush,
            save_remote=save_remote,
            load_remote=load_remote,
        )
        result = train(config, env, hooks=hooks, header_extra={"ps_latency_ms": options.latency_ms})
        ok = True
    except BaseException as err:
        abort_servers(env.num_ps, f"trainer {env.rank} failed: {type(err).__name__}: {err}")
        raise
    finally:
        ps.shutdown(graceful=ok)
    _finished(env, options)
    if env.rank == 0:
        print(f"run {result.run_id}: {result.steps} steps, QPS log {result.log_path}", flush=True)
    return 0


def _abort_server(reason: str) -> None:
    """Runs on a server (through RPC): exit with status 1 shortly after answering.

    Servers otherwise wait in a graceful ``rpc.shutdown`` for every trainer, so one failed trainer
    would keep the job (and its TorchX status) running until ``ps.join_timeout_s``.
    """
    print(f"distopt.train: error: parameter server aborting: {reason}", file=sys.stderr, flush=True)
    threading.Timer(0.2, os._exit, args=(1,)).start()


def abort_servers(num_servers: int, reason: str, *, timeout_s: float = 5.0) -> None:
    """Ask every server to exit with an error (best effort: some may already be gone)."""
    import torch.distributed.rpc as rpc

    from distopt.ps.spec import server_name

    if not rpc.api._is_current_rpc_agent_set():
        return
    futures = []
    for index in range(num_servers):
        try:
            futures.append(
                rpc.rpc_async(server_name(index), _abort_server, args=(reason,), timeout=timeout_s)
            )
        except RuntimeError:
            pass
    for fut in futures:
        try:
            fut.wait()
        except RuntimeError:
            pass  # that server is already gone


def run_ps_role(config: JobConfig, env: JobEnv) -> int:
    """Entry of every process of a job with parameter servers."""
    return serve(config, env) if env.role == "ps" else train_with_servers(config, env)
