"""The DLRM reference model: as-written and hand-async variants agree against a real PS."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

import distopt.ps as ps
from distopt.capture import DistoptTracer
from distopt.models.dlrm import DLRM, DLRMConfig, DLRMHandAsync, dlrm_loss, dlrm_tables, make_batch
from distopt.ps.client import context
from distopt.ps.spec import ServerOptions

CONFIG = DLRMConfig(num_tables=3, num_rows=50, embedding_dim=8, batch_size=6, bag_size=3)


def test_batches_are_deterministic() -> None:
    a, b = make_batch(CONFIG, 4), make_batch(CONFIG, 4)
    assert torch.equal(a.dense, b.dense) and torch.equal(a.sparse, b.sparse)
    assert a.sparse.shape == (3, 6, 3) and not torch.equal(a.sparse, make_batch(CONFIG, 5).sparse)


def test_variants_share_parameters() -> None:
    base, hand = DLRM(CONFIG), DLRMHandAsync(CONFIG)
    assert base.state_dict().keys() == hand.state_dict().keys()
    assert all(torch.equal(v, hand.state_dict()[k]) for k, v in base.state_dict().items())
    assert [t.name for t in dlrm_tables(CONFIG)] == ["emb0", "emb1", "emb2"]


def test_as_written_model_traces_to_one_fetch_per_table() -> None:
    graph = DistoptTracer().trace(DLRM(CONFIG))
    tables = [n.args[0] for n in graph.nodes if n.op == "call_function" and n.target is ps.fetch]
    assert tables == ["emb0", "emb1", "emb2"]


@pytest.fixture(scope="module")
def job() -> Iterator[ps.PSJob]:
    options = ServerOptions(num_servers=2, latency_ms=2, start_timeout_s=20)
    with ps.local_job(dlrm_tables(CONFIG), options) as job:
        yield job


def _step(
    model: DLRM, step: int
) -> tuple[torch.Tensor, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    batch = make_batch(CONFIG, step)
    model.zero_grad()
    out = model(batch.dense, batch.sparse)
    dlrm_loss(out, batch.labels).backward()
    rows = {r.table: r.rows.grad for r in context.take()}
    return out.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}, rows


@pytest.mark.slow
def test_hand_async_matches_baseline_outputs_and_gradients(job: ps.PSJob) -> None:
    base, hand = DLRM(CONFIG), DLRMHandAsync(CONFIG)
    for step in range(2):
        out_b, grads_b, rows_b = _step(base, step)
        out_h, grads_h, rows_h = _step(hand, step)
        assert torch.equal(out_b, out_h)
        assert grads_b.keys() == grads_h.keys() and all(
            torch.equal(grads_b[k], grads_h[k]) for k in grads_b
        )
        assert rows_b.keys() == {"emb0", "emb1", "emb2"} == rows_h.keys()
        assert all(torch.equal(rows_b[k], rows_h[k]) for k in rows_b)


@pytest.mark.slow
def test_training_steps_push_and_change_the_tables(job: ps.PSJob) -> None:
    model = DLRM(CONFIG)
    batch = make_batch(CONFIG, 0)
    with torch.no_grad():
        before = model(batch.dense, batch.sparse)
    for step in range(2):
        b = make_batch(CONFIG, step)
        dlrm_loss(model(b.dense, b.sparse), b.labels).backward()
        futures = ps.push_gradients(lr=0.5)  # async: the next forward's fetches order after them
        assert len(futures) == 1  # all three tables in one request
    with torch.no_grad():
        after = model(batch.dense, batch.sparse)
    assert not torch.equal(before, after)


@pytest.mark.slow
def test_verification_rows_are_never_pushed(job: ps.PSJob) -> None:
    """optimize() verifies with real fetches; those rows must not join the user's step."""
    import distopt

    batch = make_batch(CONFIG, 0)
    model = DLRM(CONFIG)
    model(batch.dense, batch.sparse)  # the user's step in progress: one record per table
    before = context.current()
    assert len(before) == CONFIG.num_tables
    distopt.optimize(model, (batch.dense, batch.sparse))
    assert context.current() == before
    ps.discard_step()
