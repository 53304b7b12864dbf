"""Running a training job process: config (:mod:`.config`), role and ranks from the environment
(:mod:`.env`), the trainer loop (:mod:`.trainer`), the parameter-server roles (:mod:`.ps_roles`),
checkpoint directories (:mod:`.checkpoint`) and what goes in them (:mod:`.state`), progress. The
entry point is :mod:`distopt.train`; :mod:`distopt.roles.supervise` restarts failed jobs."""

from distopt.dist.env import JobEnv
from distopt.training.config import JobConfig

__all__ = ["JobConfig", "JobEnv"]
