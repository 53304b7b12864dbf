"""What a parameter-server job is to its members: :class:`PSJob`, plain picklable data.

A launcher gets one from :func:`distopt.ps.start_servers` and hands it to every trainer process
(:func:`distopt.ps.init_trainer`); a ``distopt.train`` trainer builds its own from the environment
TorchX set (:mod:`distopt.roles.ps_roles`).
"""

from __future__ import annotations

import dataclasses

from distopt.dist.rendezvous import StorePlan
from distopt.ps.spec import ServerOptions, server_name

LAUNCHER = "launcher"
"""``StorePlan.hosted_by`` of jobs started by :func:`distopt.ps.start_servers`: the launching
process, outside the RPC group."""


@dataclasses.dataclass(kw_only=True, slots=True, frozen=True)
class PSJob:
    """Where a job's members meet: all a trainer needs to join (plain, picklable data)."""

    plan: StorePlan
    """The job's rendezvous stores and who hosts them (see :mod:`distopt.dist.rendezvous`)."""
    num_trainers: int
    options: ServerOptions
    pids: tuple[int, ...] = ()
    """Server process ids when started by :func:`distopt.ps.start_servers` on this machine."""
    logs: tuple[str, ...] = ()
    """Server log files (stdout + stderr), same order as ``pids``."""
    ray_address: str | None = None
    """``ps.backend: ray``: the Ray cluster holding the server actors (:mod:`distopt.ps.cluster.ray_backend`)."""
    ray_namespace: str | None = None
    """``ps.backend: ray``: the Ray namespace of this job's actors ``ps0 ..``."""

    @property
    def num_servers(self) -> int:
        return self.options.num_servers

    @property
    def world_size(self) -> int:
        return self.options.num_servers + self.num_trainers

    @property
    def servers(self) -> list[str]:
        return [server_name(i) for i in range(self.num_servers)]
