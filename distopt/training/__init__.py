"""The training side of a job process: its config (:mod:`.config`), the trainer loop
(:mod:`.trainer`) and its parts (optimizers, loss, evaluation, device, progress, logs, telemetry),
checkpoint directories (:mod:`.checkpoint`) and what goes in them (:mod:`.state`), and recovery
after a Ray server restart. The processes that run it are in :mod:`distopt.roles`; the entry
point is :mod:`distopt.train`."""

from distopt.dist.env import JobEnv
from distopt.training.config import JobConfig

__all__ = ["JobConfig", "JobEnv"]
