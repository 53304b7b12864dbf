"""The α–β model of FSDP's collectives (``distopt.estimate.collectives``): the fit, the smallest unit worth
its own collective, and one model measured once per group, cached, agreed by every rank."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp

from distopt.dist.rendezvous import StorePlan, init_gloo, spawned_gloo
from distopt.errors import ConfigError
from distopt.estimate.collectives import AlphaBeta, alpha_beta, cache_path, fit, min_unit_bytes

MODEL = AlphaBeta(
    backend="gloo",
    world_size=2,
    all_gather_alpha=1e-3,
    all_gather_beta=1e-9,
    reduce_scatter_alpha=2e-3,
    reduce_scatter_beta=1e-9,
)


def test_the_fit_recovers_alpha_and_beta_of_a_straight_line() -> None:
    points = [(n, 1e-3 + n * 1e-9) for n in (1000, 10**4, 10**6)]
    alpha, beta = fit(points)
    assert alpha == pytest.approx(1e-3) and beta == pytest.approx(1e-9)


def test_the_fit_never_gives_a_negative_latency_or_bandwidth_cost() -> None:
    alpha, beta = fit([(1000, 0.0), (2000, 1e-3)])  # the line crosses zero above 0 bytes
    assert alpha == 0.0 and beta > 0
    alpha, beta = fit([(1000, 2e-3), (2000, 1e-3)])  # noise made it slope down
    assert beta == 1e-15 and alpha == pytest.approx(1.5e-3)
    alpha, beta = fit([(4096, 1e-3), (4096, 3e-3)])  # one size only: no slope to fit
    assert beta == 1e-15 and alpha == pytest.approx(2e-3)


def test_time_is_one_all_gather_plus_one_reduce_scatter() -> None:
    assert MODEL.time(0) == pytest.approx(3e-3)
    assert MODEL.time(10**6) == pytest.approx(3e-3 + 2e-3)


def test_the_smallest_unit_is_the_half_performance_size_of_the_slower_collective() -> None:
    assert min_unit_bytes(MODEL) == pytest.approx(2e-3 / 1e-9, rel=1e-6)  # n½ = α/β
    assert min_unit_bytes(MODEL, latency_fraction=0.2) == pytest.approx(4 * 2e-3 / 1e-9, rel=1e-6)
    for bad in (0.0, 1.0, -0.5):
        with pytest.raises(
            ConfigError, match=rf"^latency_fraction: expected a number in \(0, 1\), got {bad}$"
        ):
            min_unit_bytes(MODEL, latency_fraction=bad)


@pytest.mark.slow
def test_without_a_group_it_is_measured_on_local_gloo_once_and_cached(tmp_path: Path) -> None:
    path = cache_path("gloo", 2, tmp_path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("{not json")  # a stale or broken cache is measured again, never an error
    first = alpha_beta(cache_dir=tmp_path)
    assert first.world_size == 2 and first.all_gather_beta > 0 and first.reduce_scatter_beta > 0
    assert AlphaBeta(**json.loads(path.read_text())) == first
    assert alpha_beta(cache_dir=tmp_path) == first  # served from the cache, not re-measured


PLANTED = dataclasses.replace(MODEL, world_size=2, all_gather_alpha=0.123)
"""A model no measurement gives: seeing it means the cache was read."""


def _rank(rank: int, plan: StorePlan, root: str) -> None:
    init_gloo(plan, me=f"rank{rank}", rank=rank, world_size=2, timeout_s=60.0)
    try:
        shared = Path(root, "shared")
        both_cached = alpha_beta(cache_dir=shared)
        # Rank 1 has no cache of its own: every rank measures, and all take rank 0's measurement.
        one_missing = alpha_beta(cache_dir=shared if rank == 0 else Path(root, "empty"))
        Path(root, f"rank{rank}.json").write_text(
            json.dumps([dataclasses.asdict(both_cached), dataclasses.asdict(one_missing)])
        )
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_every_rank_of_a_group_uses_one_model_measured_unless_all_have_it_cached(
    tmp_path: Path,
) -> None:
    shared = cache_path("gloo", 2, tmp_path / "shared")
    shared.parent.mkdir(parents=True)
    shared.write_text(json.dumps(dataclasses.asdict(PLANTED)))
    with spawned_gloo() as plan:
        mp.spawn(_rank, args=(plan, str(tmp_path)), nprocs=2, join=True)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [AlphaBeta(**r[0]) for r in ranks] == [PLANTED, PLANTED]
    measured = [AlphaBeta(**r[1]) for r in ranks]
    assert measured[0] == measured[1] != PLANTED and measured[0].world_size == 2
    assert AlphaBeta(**json.loads(shared.read_text())) == measured[0]  # rank 0 stored it
    assert not (tmp_path / "empty").exists()  # only rank 0 writes the cache
