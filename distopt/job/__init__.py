"""Running a training job process: config (:mod:`.config`), role and ranks from the environment
(:mod:`.env`), the trainer loop (:mod:`.trainer`), the parameter-server roles (:mod:`.ps_roles`),
checkpoint directories (:mod:`.checkpoint`) and what goes in them (:mod:`.state`), progress. The
entry point is :mod:`distopt.train`; :mod:`distopt.supervise` restarts failed jobs."""

from distopt.job.config import JobConfig
from distopt.job.env import JobEnv

__all__ = ["JobConfig", "JobEnv"]
