"""The process's place in a job, read from the environment the launcher sets.

The contract with ``distopt/torchx/components.py`` (TorchX) and with ``torchrun``:

==========================  ========================================================================
``DISTOPT_ROLE``            ``trainer`` (default) or ``ps``
``DISTOPT_NUM_PS``          parameter-server processes; 0 (default) for a job without servers
``REPLICA_ID``              index within the role (``DISTOPT_REPLICA_ID`` is accepted too)
``RANK``, ``WORLD_SIZE``    without servers: trainer rank and count (torchrun). With servers they
                            are not read (``REPLICA_ID`` and the counts below say it all)
``DISTOPT_NUM_TRAINERS``    trainers in a job with servers (``WORLD_SIZE`` counts servers too)
``LOCAL_RANK``              rank on this host (torchrun), default 0
``MASTER_ADDR/PORT``        rendezvous: the trainers' gloo group, or with servers the RPC group
``DISTOPT_PS_ADDR``         ``host:port`` of the RPC group's store (hosted by ps 0)
``DISTOPT_DDP_PORT``        port on the RPC host of the trainers' gloo-group store (hosted by ps 0)
``DISTOPT_RUN_ID``          run id shared by every process of the job
``DISTOPT_LAUNCH_RUN_DIR``  the run directory on the machine that ran ``distopt launch``, absolute
                            (set on schedulers whose replicas start in a copy of the workspace,
                            such as Ray's ``working_dir``): a process that sees it writes its
                            outputs there (:func:`distopt.training.config.launched_output_dir`)
``DISTOPT_ATTEMPT``         restarts so far (``distopt.roles.supervise``; torchrun's
                            ``TORCHELASTIC_RESTART_COUNT`` and Slurm's ``SLURM_RESTART_COUNT`` are
                            read too): a restarted job resumes from its newest complete checkpoint
==========================  ========================================================================
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import Literal

from distopt.errors import ConfigError

Role = Literal["trainer", "ps"]


def _int(env: Mapping[str, str], name: str, minimum: int) -> int | None:
    raw = env.get(name)
    if raw is None or raw == "":
        return None
    try:
        value = int(raw)
    except ValueError:
        raise ConfigError(f"environment {name}: expected an integer, got {raw!r}") from None
    if value < minimum:
        raise ConfigError(f"environment {name}: expected an integer >= {minimum}, got {raw!r}")
    return value


def _first(*values: int | None, default: int) -> int:
    return next((v for v in values if v is not None), default)


def _address(env: Mapping[str, str], name: str) -> tuple[str, int] | None:
    raw = env.get(name)
    if not raw:
        return None
    host, sep, port = raw.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"environment {name}: expected host:port, got {raw!r}")
    return host.strip("[]"), int(port)


@dataclasses.dataclass(kw_only=True, slots=True, frozen=True)
class JobEnv:
    """Where this process sits in the job."""

    role: Role = "trainer"
    rank: int = 0
    """Trainer rank, or parameter-server index for the ``ps`` role."""
    num_trainers: int = 1
    num_ps: int = 0
    local_rank: int = 0
    master_addr: str | None = None
    master_port: int | None = None
    ps_addr: tuple[str, int] | None = None
    """Host and port of the RPC group's store (jobs with servers)."""
    ddp_port: int | None = None
    """Port of the trainers' gloo store on the ``ps_addr`` host (jobs with servers)."""
    run_id: str | None = None
    launch_run_dir: str | None = None
    """``DISTOPT_LAUNCH_RUN_DIR``: the launching machine's run directory, absolute."""
    hosts: tuple[str, ...] = ()
    """Each trainer rank's host name once the trainers' group has formed (not from the
    environment): errors name the host of a peer that was lost."""
    restarts: int = 0
    """How often the launcher has restarted this job (``DISTOPT_ATTEMPT`` of ``distopt.roles.supervise``,
    torchrun's ``TORCHELASTIC_RESTART_COUNT``, Slurm's ``SLURM_RESTART_COUNT`` after a requeue):
    a restarted job resumes from its newest complete checkpoint even without ``resume: true``."""

    @classmethod
    def from_environ(cls, env: Mapping[str, str] | None = None) -> JobEnv:
        env = os.environ if env is None else env
        role = env.get("DISTOPT_ROLE") or "trainer"
        if role not in ("trainer", "ps"):
            raise ConfigError(f"environment DISTOPT_ROLE: expected 'trainer' or 'ps', got {role!r}")
        num_ps = _first(_int(env, "DISTOPT_NUM_PS", 0), default=0)
        replica = _first(_int(env, "REPLICA_ID", 0), _int(env, "DISTOPT_REPLICA_ID", 0), default=-1)
        rank_var = _int(env, "RANK", 0) if num_ps == 0 else None
        world_var = _int(env, "WORLD_SIZE", 1) if num_ps == 0 else None
        if role == "ps" and num_ps == 0:
            raise ConfigError("environment DISTOPT_NUM_PS: a ps process needs DISTOPT_NUM_PS >= 1")
        if num_ps == 0:  # torchrun or a lone process: RANK/WORLD_SIZE count trainers
            rank = _first(rank_var, replica if replica >= 0 else None, default=0)
            num_trainers = _first(world_var, _int(env, "DISTOPT_NUM_TRAINERS", 1), default=1)
        else:  # RPC ranks: servers 0..S-1, then trainers
            num_trainers = _first(_int(env, "DISTOPT_NUM_TRAINERS", 1), default=0)
            if num_trainers == 0:
                raise ConfigError(
                    "environment DISTOPT_NUM_TRAINERS: required when DISTOPT_NUM_PS > 0"
                )
            if replica < 0:
                raise ConfigError("environment REPLICA_ID: required when DISTOPT_NUM_PS > 0")
            rank = replica
        limit, what = (num_trainers, "trainers") if role == "trainer" else (num_ps, "servers")
        if not 0 <= rank < limit:
            raise ConfigError(
                f"environment: {role} index {rank} is outside 0..{limit - 1} ({limit} {what})"
            )
        master_addr = env.get("MASTER_ADDR") or None
        master_port = _int(env, "MASTER_PORT", 1)
        ps_addr = _address(env, "DISTOPT_PS_ADDR")
        if ps_addr is None and num_ps and master_addr and master_port:
            ps_addr = (master_addr, master_port)
        if num_ps and ps_addr is None:
            raise ConfigError("environment DISTOPT_PS_ADDR: required when DISTOPT_NUM_PS > 0")
        return cls(
            role=role,  # type: ignore[arg-type]
            rank=rank,
            num_trainers=num_trainers,
            num_ps=num_ps,
            local_rank=_first(_int(env, "LOCAL_RANK", 0), default=0),
            master_addr=master_addr,
            master_port=master_port,
            ps_addr=ps_addr,
            ddp_port=_int(env, "DISTOPT_DDP_PORT", 1),
            run_id=env.get("DISTOPT_RUN_ID") or None,
            launch_run_dir=env.get("DISTOPT_LAUNCH_RUN_DIR") or None,
            restarts=max(
                _int(env, name, 0) or 0
                for name in ("DISTOPT_ATTEMPT", "TORCHELASTIC_RESTART_COUNT", "SLURM_RESTART_COUNT")
            ),
        )
