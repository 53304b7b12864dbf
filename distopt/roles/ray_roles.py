"""The trainers of a ``distopt.train`` job whose parameter servers are Ray actors (``ps.backend: ray``).

Such a job has no ``ps`` processes: its TorchX app (``distopt.ps_job``) has the trainer role only,
and trainer 0 creates the servers, as :func:`distopt.ps.start_servers` does for a Python launcher:
actors ``ps0 .. ps{S-1}`` (``S`` = ``DISTOPT_NUM_PS``) in a namespace of their own
(``ps.ray_namespace`` plus a random suffix), in one placement group (``ps.ray_num_cpus``,
``ps.ray_memory_mb``, ``ps.ray_placement``), with ``ps.max_restarts``, on the cluster at
``ps.ray_address`` (:mod:`distopt.ps.cluster.ray_placement`).

Why trainer 0: it already hosts the trainers' gloo store and cuts the checkpoints, and as the
actors' owner it makes them share its fate: Ray kills a process's actors and removes its placement
group when that process exits, whatever the reason, so a failed job never leaves servers behind and
no watchdog is needed. A separate driver process would be one more role to schedule and keep alive
exactly as long as the trainers.

Start, every trainer:

1. the trainers form their gloo group, trainer 0 hosting its store at ``MASTER_ADDR:MASTER_PORT``
   as in a trainers-only job (:mod:`distopt.dist.group`);
2. trainer 0 connects to Ray and creates the actors, then broadcasts the cluster's address and the
   namespace, or its one-line error, which every trainer raises: a bad ``ps.ray_address`` fails
   the whole job within ``ps.start_timeout_s``, before any step. With ``ps.ray_address: local``
   trainer 0 starts a private Ray instance on the job's host and the other trainers join that one
   (one Ray per job, never one per trainer);
3. every trainer finds the actors by name (:func:`distopt.ps.init_trainer`).

End: every trainer drains its calls and meets the others at a barrier; then trainer 0 kills the
actors and removes their placement group (and stops the Ray instance it started, if any). A trainer
that fails leaves the gloo group, so the others fail at their next collective, trainer 0 included.
An actor that dies fails the job the same way, unless ``ps.max_restarts`` lets Ray restart it: then
every trainer rolls back to the last checkpoint and goes on (:mod:`distopt.training.recovery`).
"""

from __future__ import annotations

import contextlib
import datetime
from collections.abc import Iterator
from typing import Any

import torch.distributed as dist

import distopt.ps as ps
from distopt.dist import rendezvous
from distopt.dist.env import JobEnv
from distopt.dist.group import store_plan
from distopt.dist.rendezvous import StorePlan
from distopt.errors import ConfigError, DistoptError, RemoteCallError
from distopt.ps.cluster.session import session
from distopt.ps.spec import ServerOptions, trainer_name
from distopt.roles.ps_setup import job_tables
from distopt.training.config import JobConfig
from distopt.training.logs import record_failure


@contextlib.contextmanager
def actor_servers(
    config: JobConfig, env: JobEnv, options: ServerOptions, *, gloo: bool
) -> Iterator[None]:
    """Start (trainer 0) or find the job's server actors and join them for the ``with`` block."""
    me = trainer_name(env.rank)
    plan = store_plan(env) if gloo else StorePlan(host=options.host, hosted_by=trainer_name(0))
    with rendezvous.host_stores(plan, me=me, timeout_s=options.start_timeout_s) as hosted:
        if gloo:
            rendezvous.init_gloo(
                hosted.plan,
                me=me,
                rank=env.rank,
                world_size=env.num_trainers,
                timeout_s=options.start_timeout_s,
            )
        job = None
        try:
            job = _start_or_find(config, env, options, hosted.plan, gloo=gloo)
            ps.init_trainer(job, rank=env.rank)
            yield
            ps.flush()
            if gloo:
                dist.barrier()  # no trainer calls the actors any more
        except BaseException as err:
            record_failure(err)
            ps.abort(f"trainer {env.rank} failed: {type(err).__name__}: {err}")  # leaves gloo too
            raise
        else:
            ps.shutdown()
        finally:
            if env.rank == 0 and job is not None:
                ps.stop_servers(job)


def _start_or_find(
    config: JobConfig, env: JobEnv, options: ServerOptions, plan: StorePlan, *, gloo: bool
) -> ps.PSJob:
    """Trainer 0 creates the actors; every trainer gets their cluster and namespace, or raises
    trainer 0's error."""
    answer: list[Any] = [None]
    failure: BaseException | None = None
    waiting = None
    if gloo:
        # Trainer 0 may take ps.start_timeout_s to reach Ray and as long again to place the actors
        # (distopt.ps.cluster.ray_placement): the others wait that long for its answer (a group
        # of its own, formed by all trainers before trainer 0 starts).
        timeout = datetime.timedelta(seconds=2 * options.start_timeout_s + 30)
        waiting = dist.new_group(backend="gloo", timeout=timeout)
    if env.rank == 0:
        try:
            tables = job_tables(config)
            job = session().start(tables, options, num_trainers=env.num_trainers, plan=plan)
            answer[0] = ("ok", (job.ray_address, job.ray_namespace))
        except BaseException as err:  # the others must hear of it, whatever it is
            failure = err
            if isinstance(err, ConfigError):  # a bad ps.* key: every trainer says the same line
                answer[0] = ("config", str(err))
            else:
                text = str(err) if isinstance(err, DistoptError) else f"{type(err).__name__}: {err}"
                answer[0] = ("remote", f"trainer 0 could not start the server actors: {text}")
    if waiting is not None:
        dist.broadcast_object_list(answer, src=0, group=waiting)
        dist.destroy_process_group(waiting)
    if failure is not None:
        raise failure
    kind, value = answer[0]
    if kind != "ok":
        raise ConfigError(value) if kind == "config" else RemoteCallError(value)
    address, namespace = value
    return ps.PSJob(
        plan=plan,
        num_trainers=env.num_trainers,
        options=options,
        ray_address=address,
        ray_namespace=namespace,
    )
