"""Benchmarks run by ``distopt bench CONFIG.yaml``.

A benchmark config names its ``kind``; ``distopt/bench/<kind>.py`` provides
``run(config: dict, args: argparse.Namespace) -> int`` which validates the rest of the config
(a dataclass through :func:`distopt.config.from_dict`), prints a rich table and, with
``--json PATH``, writes machine-readable results. Variants are measured interleaved in one run;
reports quote medians and ratios. Benchmarks with a ``device`` key run on ``cpu`` (default),
``cuda`` or ``auto``; time read around GPU work waits for the GPU first
(:func:`distopt.estimate.ab.now` and the clocks of that module).
"""

from __future__ import annotations

import importlib
import math
import pkgutil
import statistics
from collections.abc import Sequence

from distopt.errors import ConfigError


def kinds() -> list[str]:
    return sorted(
        info.name for info in pkgutil.iter_modules(__path__) if not info.name.startswith("_")
    )


def load(kind: str):
    if kind not in kinds():
        raise ConfigError(f"kind: unknown benchmark {kind!r} (known: {', '.join(kinds())})")
    return importlib.import_module(f"{__name__}.{kind}")


def quantile(values: Sequence[float], q: float) -> float:
    """Linear-interpolation quantile (q in [0, 1]) of a non-empty sample."""
    ordered = sorted(values)
    if len(ordered) == 1:
        return ordered[0]
    pos = q * (len(ordered) - 1)
    low = int(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def median(values: Sequence[float]) -> float:
    return statistics.median(values)


def steps_lasting(steps: int, warmup: int, median_step_s: float, seconds: float, most: int) -> int:
    """Steps of a job or chunk whose steps after ``warmup`` last ``seconds`` at ``median_step_s``
    a step: ``steps`` when they already do, else as many more as it takes, at most ``most``."""
    if (steps - warmup) * median_step_s >= seconds:
        return steps
    needed = warmup + math.ceil(seconds / median_step_s)
    return max(steps, min(needed, most))
