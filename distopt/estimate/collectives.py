"""An α–β cost model of a process group's collectives, measured once and cached on disk.

``time(n bytes) ≈ α + β·n`` for all-gather and reduce-scatter (the two collectives FSDP issues per
unit). :func:`alpha_beta` measures them on the current process group (every rank must call it) or,
without one, on a throw-away 2-rank gloo group on 127.0.0.1, and caches the fit under
``~/.cache/distopt`` (``$DISTOPT_CACHE_DIR`` or ``cache_dir`` override it). :func:`min_unit_bytes`
turns the model into the smallest unit worth its own collective.
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import statistics
import tempfile
import time
from pathlib import Path
from typing import cast

import torch
import torch.distributed as dist

from distopt.config import check
from distopt.dist.rendezvous import run_spawned

SIZES = (16 * 1024, 256 * 1024, 1024 * 1024, 4 * 1024 * 1024)
"""Bytes of the gathered tensor per measurement point."""


@dataclasses.dataclass(kw_only=True, slots=True)
class AlphaBeta:
    """Latency (seconds) and inverse bandwidth (seconds per byte) of FSDP's collectives."""

    backend: str
    world_size: int
    all_gather_alpha: float
    all_gather_beta: float
    reduce_scatter_alpha: float
    reduce_scatter_beta: float

    def time(self, nbytes: int) -> float:
        """Predicted seconds of one all-gather plus one reduce-scatter of ``nbytes``."""
        return (
            self.all_gather_alpha
            + self.reduce_scatter_alpha
            + (self.all_gather_beta + self.reduce_scatter_beta) * nbytes
        )


def fit(points: list[tuple[int, float]]) -> tuple[float, float]:
    """Least-squares ``(α, β)`` of ``seconds = α + β·bytes``, clamped to be non-negative."""
    n = len(points)
    mx = sum(b for b, _ in points) / n
    my = sum(t for _, t in points) / n
    var = sum((b - mx) ** 2 for b, _ in points)
    beta = sum((b - mx) * (t - my) for b, t in points) / var if var else 0.0
    beta = max(beta, 1e-15)
    alpha = max(my - beta * mx, 0.0)
    return alpha, beta


# torch >= 2.10 renamed the tensor-in/tensor-out collectives; older releases only have the old names.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def measure(
    group: dist.ProcessGroup | None = None, *, sizes: tuple[int, ...] = SIZES, iters: int = 5
) -> AlphaBeta:
    """Time all-gather/reduce-scatter on ``group`` (a collective call: every rank runs it)."""
    world = dist.get_world_size(group)
    results: dict[str, list[tuple[int, float]]] = {"ag": [], "rs": []}
    for nbytes in sizes:
        numel = max(nbytes // 4 // world, 1)
        shard = torch.ones(numel)
        full = torch.empty(numel * world)
        for name in ("ag", "rs"):
            samples = []
            for i in range(iters + 1):
                dist.barrier(group)
                start = time.perf_counter()
                if name == "ag":
                    _all_gather(full, shard, group=group)
                else:
                    _reduce_scatter(shard, full, group=group)
                if i:  # the first call pays connection set-up
                    samples.append(time.perf_counter() - start)
            elapsed = torch.tensor([statistics.median(samples)])
            dist.all_reduce(
                elapsed, op=dist.ReduceOp.MAX, group=group
            )  # the slowest rank sets pace
            results[name].append((numel * world * 4, float(elapsed)))
    ag, rs = fit(results["ag"]), fit(results["rs"])
    return AlphaBeta(
        backend=str(dist.get_backend(group)),
        world_size=world,
        all_gather_alpha=ag[0],
        all_gather_beta=ag[1],
        reduce_scatter_alpha=rs[0],
        reduce_scatter_beta=rs[1],
    )


def _local_worker(rank: int, out: str) -> None:
    model = measure()
    if rank == 0:
        Path(out).write_text(json.dumps(dataclasses.asdict(model)))


def measure_local(world_size: int = 2) -> AlphaBeta:
    """Measure on a fresh ``world_size``-rank gloo group of local processes (127.0.0.1)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "alpha_beta.json")
        run_spawned(_local_worker, out, world_size=world_size, what="alpha_beta", timeout_s=60.0)
        return AlphaBeta(**json.loads(Path(out).read_text()))


def cache_path(
    backend: str, world_size: int, cache_dir: str | os.PathLike[str] | None = None
) -> Path:
    root = Path(
        cache_dir or os.environ.get("DISTOPT_CACHE_DIR") or Path.home() / ".cache" / "distopt"
    )
    return root / f"alpha_beta-{socket.gethostname()}-{backend}-w{world_size}.json"


def _load(path: Path) -> AlphaBeta | None:
    try:
        return AlphaBeta(**json.loads(path.read_text()))
    except (OSError, ValueError, TypeError):
        return None  # missing or stale format: measure again


def _store(path: Path, model: AlphaBeta) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(dataclasses.asdict(model), indent=1))
    os.replace(tmp, path)  # atomic: concurrent jobs never read half a file


def alpha_beta(
    *,
    group: dist.ProcessGroup | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
    refresh: bool = False,
) -> AlphaBeta:
    """The cached α–β model of ``group`` (the default group if initialized, else local gloo).

    With a process group, all ranks agree on one model (rank 0's), so every rank derives the
    same unit sizes.
    """
    if dist.is_available() and dist.is_initialized():
        backend, world = str(dist.get_backend(group)), dist.get_world_size(group)
        path = cache_path(backend, world, cache_dir)
        cached = None if refresh else _load(path)
        missing = torch.tensor([0 if cached else 1])
        dist.all_reduce(missing, group=group)  # any rank without a cache → all measure
        # missing == 0 after the all-reduce: every rank, this one included, has a cached model.
        model = measure(group) if int(missing) else cast(AlphaBeta, cached)
        box = [model]
        dist.broadcast_object_list(
            box, src=dist.get_global_rank(group, 0) if group else 0, group=group
        )
        model = box[0]
        if dist.get_rank(group) == 0 and (int(missing) or refresh):
            _store(path, model)
        return model
    path = cache_path("gloo", 2, cache_dir)
    cached = None if refresh else _load(path)
    if cached is not None:
        return cached
    model = measure_local(2)
    _store(path, model)
    return model


def min_unit_bytes(model: AlphaBeta, latency_fraction: float = 0.5) -> int:
    """Smallest unit whose collectives spend at most ``latency_fraction`` of their time on latency.

    ``α ≤ f·(α + β·n)``  ⇔  ``n ≥ α·(1 − f) / (f·β)``, taken for the worse of the two collectives.
    The default ``f = 0.5`` gives Hockney's half-performance size ``n½ = α/β``: a unit that small
    already reaches half the link's bandwidth, and larger units only cost memory.
    """
    check(0.0 < latency_fraction < 1.0, "latency_fraction", "a number in (0, 1)", latency_fraction)
    f = latency_fraction
    need = [
        alpha * (1 - f) / (f * beta)
        for alpha, beta in (
            (model.all_gather_alpha, model.all_gather_beta),
            (model.reduce_scatter_alpha, model.reduce_scatter_beta),
        )
    ]
    return int(max(need))
