"""Graph passes: registry, runner and the built-in passes."""

from distopt.passes.core.base import (
    PassContext,
    PassFn,
    PassResult,
    PassSpec,
    register_pass,
    registered_passes,
    resolve_pipeline,
    unregister_pass,
)
from distopt.passes.core.runner import run_passes
from distopt.passes.core.side_effects import eliminate_dead_code, is_impure, mark_side_effectful

__all__ = [
    "PassContext",
    "PassFn",
    "PassResult",
    "PassSpec",
    "eliminate_dead_code",
    "is_impure",
    "mark_side_effectful",
    "register_pass",
    "registered_passes",
    "resolve_pipeline",
    "run_passes",
    "unregister_pass",
]
