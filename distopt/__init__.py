"""distopt: torch.fx graph rewrites that make distributed training jobs faster."""

from distopt.config import CaptureConfig, OptimizeConfig, VerifyConfig
from distopt.errors import (
    CaptureError,
    ConfigError,
    DistoptError,
    DistoptFallbackWarning,
    PassError,
    RemoteCallError,
    VerificationError,
)
from distopt.explain import explain
from distopt.optimize import optimize
from distopt.parallel import ParallelizeConfig, parallelize
from distopt.passes import PassContext, PassResult, register_pass
from distopt.remote import register_read, register_remote, remote

__version__ = "0.1.0"

__all__ = [
    "CaptureConfig",
    "CaptureError",
    "ConfigError",
    "DistoptError",
    "DistoptFallbackWarning",
    "OptimizeConfig",
    "ParallelizeConfig",
    "PassContext",
    "PassError",
    "PassResult",
    "RemoteCallError",
    "VerificationError",
    "VerifyConfig",
    "explain",
    "optimize",
    "parallelize",
    "register_pass",
    "register_read",
    "register_remote",
    "remote",
]
