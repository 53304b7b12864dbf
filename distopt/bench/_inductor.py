"""Inductor's costs that belong to the machine, not to a model's compile: what the benchmarks that
time a cold compile (``regional_compile``, ``third_party_fusion``) pay before timing."""

from __future__ import annotations

import time
from collections.abc import Callable

_pick_vec_isa: Callable[[], object] | None
try:  # a private API that may move
    from torch._inductor.cpu_vec_isa import pick_vec_isa as _pick_vec_isa
except ImportError:
    _pick_vec_isa = None


def probe_inductor_cpu() -> float:
    """Run Inductor's CPU vector-ISA probe now; returns its seconds.

    Inductor's first CPU compile in a process checks which vector instruction sets build and load
    here by compiling a test program per ISA (7.5-8.0 s of g++ on this project's 2-core host),
    and keeps the answer for the process and in its cache directory: a fact about the machine,
    paid once per cache directory (by default ``/tmp/torchinductor_$USER``; a fresh container or
    a job with a private ``/tmp`` pays it again), not a cost of compiling a model. A benchmark
    timing a cold compile with a fresh cache directory per run calls this first in every
    variant, so each variant's compile time is its own graphs' (as its precompiled header,
    which Inductor keeps outside the cache directory, already was); the probe's seconds go in
    the benchmark's JSON, for the ratio with them.
    """
    if _pick_vec_isa is None:  # another torch release: the probe, if any, stays in the compile
        return 0.0
    start = time.perf_counter()
    _pick_vec_isa()
    return time.perf_counter() - start
