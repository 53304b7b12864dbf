"""Row caches on real parameter servers, both transports: the same rows and tables as without a
cache, fewer rows sent, and the trainer's counts equal to what the servers counted."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import distopt.ps as ps
from distopt.errors import ConfigError
from distopt.ps.spec import CacheConfig, ServerOptions, TableSpec

TABLES = (
    TableSpec(name="sgd", num_rows=10, dim=4),
    TableSpec(name="ada", num_rows=12, dim=3, optimizer="adagrad"),
    TableSpec(name="row", num_rows=9, dim=2, optimizer="rowwise_adagrad"),
    TableSpec(name="dense", num_rows=3, dim=5, kind="dense"),
)
CACHE = {
    "sgd": CacheConfig(capacity_rows=4),
    "ada": CacheConfig(capacity_rows=6, policy="lfu"),
    "row": CacheConfig(capacity_bytes=400),
}


def _options(backend: str, cache: dict[str, CacheConfig]) -> ServerOptions:
    return ServerOptions(
        backend=backend,
        num_servers=2,
        seed=5,
        latency_ms=2,
        rpc_timeout_s=20.0,
        start_timeout_s=30.0,
        cache=cache,
    )


def _rows_served() -> int:
    return sum(ps.server_stats(s).get("rows_served", 0) for s in ("ps0", "ps1"))


def _train(options: ServerOptions) -> dict[str, Any]:
    """Fetches (blocking, and batched over every table) and pushes (not waited) from fixed seeds:
    every fetch's rows, the servers' state afterwards, and both sides' counts."""
    gen = torch.Generator().manual_seed(11)
    fetched = []
    with ps.local_job(TABLES, options):
        ps.take_fetch_counts()
        served = _rows_served()
        for step in range(10):
            pushes = []
            for spec in TABLES:
                ids = torch.randint(0, spec.num_rows, (7,), generator=gen)
                with torch.no_grad():
                    fetched.append(ps.fetch(spec.name, ids))
                pushes.append((spec.name, ids, torch.randn(7, spec.dim, generator=gen)))
                if step % 2 == 0:
                    ps.push_async(*pushes[-1], lr=0.3)
            if step % 2:
                ps.push_many_async(pushes, lr=0.3)
            with torch.no_grad():  # every table at once: cached and uncached pieces per server
                fetched += ps.wait(ps.fetch_many_async([(s.name, None) for s in TABLES]))
        counts = ps.take_fetch_counts()
        served = _rows_served() - served
        state = ps.state_dict()
    return {"fetched": fetched, "state": state, "counts": counts, "served": served}


@pytest.mark.parametrize("backend", ["rpc", pytest.param("ray", marks=pytest.mark.slow)])
def test_cached_job_equals_the_uncached_one_and_fetches_fewer_rows(
    backend: str, request: pytest.FixtureRequest
) -> None:
    if backend == "ray":
        pytest.importorskip("ray")
        request.getfixturevalue("ray_cluster")
    plain = _train(_options(backend, {}))
    cached = _train(_options(backend, CACHE))
    assert len(plain["fetched"]) == len(cached["fetched"])
    assert all(torch.equal(a, b) for a, b in zip(plain["fetched"], cached["fetched"], strict=True))
    for server, shards in plain["state"].items():
        for table, state in shards.items():
            for key, value in state.items():
                other = cached["state"][server][table][key]
                assert (
                    torch.equal(value, other) if isinstance(value, torch.Tensor) else value == other
                )
    # The trainer counts what the servers counted; the cache served some ids, so fewer rows.
    assert plain["counts"].rows == plain["served"] and plain["counts"].lookups == 0
    assert cached["counts"].rows == cached["served"] < plain["served"]
    assert cached["counts"].hits > 0 and cached["counts"].hit_rate is not None
    assert cached["counts"].cache_bytes > 0 and cached["counts"].staleness_max == 0


def test_a_cache_of_a_table_the_job_lacks_is_refused_before_servers_start() -> None:
    options = _options("rpc", {"nope": CacheConfig(capacity_rows=3)})
    with pytest.raises(ConfigError, match=r"^ps\.cache\.nope: the model has no table 'nope'"):
        with ps.local_job(TABLES, options):
            pass


def test_the_cost_models_rehearsal_leaves_the_jobs_caches_as_they_were() -> None:
    """The rehearsal fetches through empty caches of its own: the job's caches hold afterwards
    what they held before (filled with the rehearsal's rows, a staleness-1 cache served stale
    rows from the job's first step on)."""
    import copy

    import distopt
    from distopt.models.dlrm import DLRM, DLRMConfig, dlrm_tables, make_batch
    from distopt.optimize.gain import predict_gain
    from distopt.ps.client import calls as ps_calls

    cfg = DLRMConfig(num_tables=2, compute="light", batch_size=8, num_rows=200, embedding_dim=4)
    caches = {t.name: CacheConfig(capacity_rows=100) for t in dlrm_tables(cfg)}
    options = ServerOptions(
        num_servers=1, seed=5, rpc_timeout_s=20.0, start_timeout_s=30.0, cache=caches
    )
    batches = [make_batch(cfg, step) for step in range(4)]
    with ps.local_job(dlrm_tables(cfg), options):
        model = DLRM(cfg)
        example = (batches[0].dense, batches[0].sparse)
        optimized = distopt.optimize(copy.deepcopy(model), example, strict=True)
        ps.discard_step()
        held = ps_calls.current().caches
        before = {name: cache.held_ids().clone() for name, cache in held.items()}
        assert any(len(ids) for ids in before.values())  # optimize's verification fetched
        predict_gain(
            model,
            optimized,
            example,
            latency_s=0.001,
            measure_step=True,
            repeats=2,
            batches=[(b.dense, b.sparse) for b in batches],
        )
        assert ps_calls.current().caches is held
        for name, cache in held.items():
            assert torch.equal(cache.held_ids(), before[name]), name
