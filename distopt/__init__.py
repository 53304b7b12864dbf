"""distopt: torch.fx graph rewrites that make distributed training jobs faster."""

from distopt.config import CaptureConfig, OptimizeConfig, VerifyConfig
from distopt.errors import (
    CaptureError,
    ConfigError,
    DistoptError,
    DistoptFallbackWarning,
    DistoptUnverifiedWarning,
    PassError,
    RemoteCallError,
    VerificationError,
)
from distopt.optimize import explain, optimize
from distopt.parallel import ParallelizeConfig, parallelize
from distopt.passes import PassContext, PassResult, register_pass
from distopt.remote import register_batched, register_read, register_remote, register_write, remote
from distopt.torchx.submit import launch

__version__ = "0.1.0"

__all__ = [
    "CaptureConfig",
    "CaptureError",
    "ConfigError",
    "DistoptError",
    "DistoptFallbackWarning",
    "DistoptUnverifiedWarning",
    "OptimizeConfig",
    "ParallelizeConfig",
    "PassContext",
    "PassError",
    "PassResult",
    "RemoteCallError",
    "VerificationError",
    "VerifyConfig",
    "explain",
    "launch",
    "optimize",
    "parallelize",
    "register_batched",
    "register_pass",
    "register_read",
    "register_remote",
    "register_write",
    "remote",
]
