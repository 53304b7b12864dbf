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

# `distopt.launch` is the launch function below; the TorchX components live in the package of the
# same name (distopt/launch/). Importing a package binds it as an attribute of its parent, so the
# package is imported first and the function bound after it: a later import of
# distopt.launch.components (TorchX loads it by entry point) finds the package in sys.modules
# and leaves the attribute alone.
import distopt.launch as _components_package  # noqa: E402,F401  isort: skip
from distopt.job.launch import launch  # noqa: E402  isort: skip

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
