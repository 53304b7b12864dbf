"""Micro-timing of one parameter-server round trip through the public client API.

    python tools/ps_roundtrip.py --backend rpc --calls 2000
    python tools/ps_roundtrip.py --backend ray --calls 2000

One server process (or actor) with no injected latency, this process the only trainer. Prints one
JSON line: the median and the 10th/90th percentiles, in microseconds, of a blocking ``fetch`` of
64 rows, a batched ``fetch_many_async`` of 4 tables (one request) and a blocking ``push``. Used to
check that a change to the client, the transports or the server keeps the hot path as fast as it
was: run the two trees alternately (``PYTHONPATH=<other tree>``) on a quiet machine and compare
the medians. Not a benchmark with a target (those are ``distopt bench``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch

import distopt.ps as ps
from distopt.ps.spec import ServerOptions, TableSpec

TABLES = tuple(TableSpec(name=f"t{i}", num_rows=10_000, dim=16) for i in range(4))


def _timed(fn: Callable[[], object], calls: int) -> dict[str, float]:
    for _ in range(min(200, calls)):  # warm up: connections, allocator, Ray workers
        fn()
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e6)
    times.sort()
    return {
        "median_us": round(statistics.median(times), 1),
        "p10_us": round(times[len(times) // 10], 1),
        "p90_us": round(times[9 * len(times) // 10], 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=("rpc", "ray"), default="rpc")
    parser.add_argument("--calls", type=int, default=2000)
    args = parser.parse_args()
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 10_000, (64,), generator=gen)
    grads = torch.randn(64, 16, generator=gen)
    options = ServerOptions(backend=args.backend, num_servers=1, rpc_timeout_s=60.0)
    with ps.local_job(TABLES, options), torch.no_grad():
        result = {
            "backend": args.backend,
            "fetch": _timed(lambda: ps.fetch("t0", ids), args.calls),
            "fetch_many4": _timed(
                lambda: ps.wait(ps.fetch_many_async([(t.name, ids) for t in TABLES])), args.calls
            ),
            "push": _timed(lambda: ps.push("t0", ids, grads, lr=0.01), args.calls),
        }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
