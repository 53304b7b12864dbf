"""Synthetic runs written with the real QPS log writer (shared by the metrics and CLI tests)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from distopt.metrics.qps_log import QpsLogWriter

BATCH = 64
WriteRun = Callable[..., Path]
"""``write_run(run_id, qps_mean, **options)`` bound to a directory."""

CONFIG: dict[str, Any] = {"model": "mlp", "model_kwargs": {"hidden": 64}, "lr": 0.01, "steps": 200}


def write_synthetic_run(
    out_dir: Path,
    run_id: str,
    qps_mean: float,
    *,
    variant: str = "baseline",
    steps: int = 200,
    cv: float = 0.03,
    seed: int = 0,
    world_size: int = 1,
    config: dict[str, Any] | None = None,
    extra: dict[str, Any] | None = None,
) -> Path:
    """Write run ``run_id`` whose per-step QPS is normal(qps_mean, cv * qps_mean); its directory."""
    rng = np.random.default_rng(seed)
    for rank in range(world_size):
        with QpsLogWriter.create(
            out_dir,
            run_id=run_id,
            variant=variant,
            rank=rank,
            world_size=world_size,
            global_batch_size=BATCH,
            config={**CONFIG, "variant": variant, "run_id": run_id, **(config or {})},
            extra=extra,
        ) as writer:
            for step in range(steps):
                qps = max(rng.normal(qps_mean, cv * qps_mean), 1.0)
                writer.log_step(step, BATCH / qps)
    return out_dir / run_id
