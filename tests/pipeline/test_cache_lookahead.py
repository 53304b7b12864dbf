"""The pipeline's window is the row caches' lookahead: the rows of the batches in flight and of
the batch in hand are pinned, and an exact cache leaves a pipelined run bitwise unchanged. A
prefetch that leaves before this trainer's last push is answered still hits its cached rows."""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import pytest
import torch

import distopt
import distopt.ps as ps
from distopt.models.dlrm import DLRM, DLRMConfig, dlrm_loss, dlrm_tables, make_batch
from distopt.pipeline import TrainPipeline
from distopt.ps.client import calls
from distopt.ps.client.cache import TableCache, build_caches
from distopt.ps.spec import CacheConfig, ServerOptions
from tests.pipeline.conftest import bitwise_equal

CONFIG = DLRMConfig(num_tables=2, num_rows=300, embedding_dim=8, batch_size=8, bag_size=3)
STEPS = 8
STALENESS = 2
CAPACITY = 60  # about as many rows as the window's three batches hold: the pins decide


@pytest.fixture(scope="module")
def job() -> Iterator[dict[str, torch.Tensor]]:
    cache = {t.name: CacheConfig(capacity_rows=CAPACITY) for t in dlrm_tables(CONFIG)}
    options = ServerOptions(num_servers=2, start_timeout_s=30, cache=cache)
    with ps.local_job(dlrm_tables(CONFIG), options):
        yield ps.state_dict()


def _run(
    initial: dict,
    *,
    cached: bool | Mapping[str, TableCache],
    staleness: int = STALENESS,
    deterministic: bool = True,
    ordered_pushes: bool = False,
) -> tuple[list[float], dict, list[dict[str, set[int]]]]:
    """A pipelined run ``staleness`` ahead (with the job's caches, with ``cached`` ones, or
    with none); its losses, its tables and, after each step, each cache's pinned rows. With
    ``ordered_pushes`` a relaxed run's pushes keep their issue order among themselves (its
    prefetches still do not hold them back)."""
    ps.load_state_dict(initial)
    client = calls.current()
    chosen = client.caches if cached is True else (cached or {})
    caches, client.caches = client.caches, dict(chosen)
    batches = [make_batch(CONFIG, step) for step in range(STEPS)]
    torch.manual_seed(0)
    gm = distopt.optimize(DLRM(CONFIG), (batches[0].dense, batches[0].sparse), strict=True)
    ps.discard_step()
    pipe = TrainPipeline(
        gm,
        torch.optim.SGD(gm.parameters(), lr=0.01),
        iter(batches),
        staleness=staleness,
        loss_fn=lambda out, batch: dlrm_loss(out, batch.labels),
        inputs=lambda batch: (batch.dense, batch.sparse),
        push=lambda: _push(ordered_pushes),
        deterministic=deterministic,
    )
    losses, pinned = [], []
    try:
        for out in pipe.run():
            losses.append(out.loss.item())
            pinned.append(
                {name: set(cache.pinned.tolist()) for name, cache in client.caches.items()}
            )
        pipe.close()
        ps.flush()
        return losses, ps.state_dict(), pinned
    finally:
        client.caches = caches


def _push(ordered: bool) -> None:
    if ordered:
        calls.set_stale_pushes(False)  # the relaxed pipeline turned it on when it started
    ps.push_gradients(lr=0.5)


def test_the_window_pins_its_rows_and_an_exact_cache_changes_nothing(job: dict) -> None:
    plain_losses, plain_tables, _ = _run(job, cached=False)
    losses, tables, pinned = _run(job, cached=True)
    assert losses == plain_losses
    assert bitwise_equal(tables, plain_tables)
    batches = [make_batch(CONFIG, step) for step in range(STEPS)]
    for step, held in enumerate(pinned):
        window = batches[step : step + STALENESS + 1]  # in hand, then in flight
        for k, table in enumerate(CONFIG.table_names):
            expected = {int(i) for b in window for i in b.sparse[k].reshape(-1)}
            assert held[table] == expected, (step, table)
    counts = ps.take_fetch_counts()
    assert counts.hits > 0 and counts.staleness_max == 0


def test_a_prefetch_ahead_of_the_last_push_hits_and_reads_what_issue_order_reads(
    job: dict,
) -> None:
    """Staleness 1 without ``deterministic``: batch t+1's rows are looked up while the push of
    step t is in flight (the servers' latency makes it reach them first). The servers tell the
    cache's own pushes from others', so every row fetched before is served from the cache, as
    it was when the prefetch was issued: the run is bitwise the one in issue order. (Pushes
    keep their order among themselves here: a relaxed pipeline may also apply a table's
    pushes in either order, which changes float rounding with or without a cache.)"""
    plain_losses, plain_tables, _ = _run(job, cached=False, staleness=1)
    tables = {t: (r.spec, len(r.servers)) for t, r in calls.routes().items()}
    whole = {t.name: CacheConfig(capacity_rows=CONFIG.num_rows) for t in dlrm_tables(CONFIG)}
    ps.set_latency_ms(20.0)
    try:
        ps.take_fetch_counts()
        losses, got, _ = _run(
            job,
            cached=build_caches(whole, tables),
            staleness=1,
            deterministic=False,
            ordered_pushes=True,
        )
        counts = ps.take_fetch_counts()
    finally:
        ps.set_latency_ms(0.0)
    assert losses == plain_losses
    assert bitwise_equal(got, plain_tables)
    # Every id fetched before is a hit: only first sightings go to the servers (the first batch
    # is fetched once more, first, by distopt.optimize's verification).
    batches = [make_batch(CONFIG, step) for step in range(STEPS)]
    batches.insert(0, batches[0])
    seen: list[set[int]] = [set() for _ in CONFIG.table_names]
    again = 0
    for batch in batches:
        for k, ids in enumerate(batch.sparse):
            flat = ids.reshape(-1).tolist()
            again += sum(i in seen[k] for i in flat)
            seen[k].update(flat)
    assert counts.lookups == sum(b.sparse[k].numel() for b in batches for k in range(2))
    assert counts.hits == again and counts.staleness_max == 0
