"""Data parallelism for optimized graphs: units as modules, DDP/FSDP2/FSDP1, ``parallelize``."""

from distopt.parallel.apply import apply_compile, apply_ddp, apply_fsdp, apply_fsdp1
from distopt.parallel.parallelize import (
    ParallelizeConfig,
    parallelize,
    timing_of,
)
from distopt.parallel.units import materialize_units, plan_of, unit_modules

__all__ = [
    "ParallelizeConfig",
    "apply_compile",
    "apply_ddp",
    "apply_fsdp",
    "apply_fsdp1",
    "materialize_units",
    "parallelize",
    "plan_of",
    "timing_of",
    "unit_modules",
]
