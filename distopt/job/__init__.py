"""Running a training job process: config (:mod:`.config`), role and ranks from the environment
(:mod:`.env`), the trainer loop (:mod:`.trainer`), the parameter-server role (:mod:`.ps_job`),
checkpoints and progress. The entry point is :mod:`distopt.train`."""

from distopt.job.config import JobConfig
from distopt.job.env import JobEnv

__all__ = ["JobConfig", "JobEnv"]
