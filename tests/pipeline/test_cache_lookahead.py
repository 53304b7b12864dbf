"""The pipeline's window is the row caches' lookahead: the rows of the batches in flight and of
the batch in hand are pinned, and an exact cache leaves a pipelined run bitwise unchanged."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

import distopt
import distopt.ps as ps
from distopt.models.dlrm import DLRM, DLRMConfig, dlrm_loss, dlrm_tables, make_batch
from distopt.pipeline import TrainPipeline
from distopt.ps.client import calls
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


def _run(initial: dict, *, cached: bool) -> tuple[list[float], dict, list[dict[str, set[int]]]]:
    """A deterministic pipelined run ``STALENESS`` ahead (with the caches, or with them set
    aside); its losses, its tables and, after each step, each cache's pinned rows."""
    ps.load_state_dict(initial)
    client = calls.current()
    caches, client.caches = client.caches, (client.caches if cached else {})
    batches = [make_batch(CONFIG, step) for step in range(STEPS)]
    torch.manual_seed(0)
    gm = distopt.optimize(DLRM(CONFIG), (batches[0].dense, batches[0].sparse), strict=True)
    ps.discard_step()
    pipe = TrainPipeline(
        gm,
        torch.optim.SGD(gm.parameters(), lr=0.01),
        iter(batches),
        staleness=STALENESS,
        loss_fn=lambda out, batch: dlrm_loss(out, batch.labels),
        inputs=lambda batch: (batch.dense, batch.sparse),
        push=lambda: ps.push_gradients(lr=0.5),
        deterministic=True,
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
