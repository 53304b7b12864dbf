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
import pkgutil
import statistics
import time
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


def probe_inductor_cpu() -> float:
    """Run Inductor's CPU vector-ISA probe now; returns its seconds.

    Inductor's first CPU compile in a process checks which vector instruction sets build and load
    here by compiling a test program per ISA (7.7 s of g++ on this project's 2-core host), and
    keeps the answer for the process and in its cache directory. It is a fact about the machine,
    paid once per machine by a user's default cache directory, not a cost of compiling a model:
    a benchmark timing a cold compile with a fresh cache directory per run calls this first in
    every variant, so each variant's compile time is its own graphs' (as its precompiled header,
    built once per machine, already is).
    """
    try:
        from torch._inductor.cpu_vec_isa import pick_vec_isa
    except ImportError:  # another torch release: the probe, if any, stays in the compile
        return 0.0
    start = time.perf_counter()
    pick_vec_isa()
    return time.perf_counter() - start
