"""The scheduling passes against real parameter-server processes (loopback RPC, 2 servers)."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import torch
from torch import nn

import distopt
import distopt.ps as ps
from distopt.capture import symbolic_capture
from distopt.config import CaptureConfig
from distopt.estimate import predict
from distopt.ps.client import context as ps_context
from distopt.ps.spec import ServerOptions, TableSpec

pytestmark = pytest.mark.slow

PASSES = ["split_remote", "hoist_issue", "batch_fetch", "sink_wait"]
LATENCY_MS = 20
DIM = 4
# Three tables on both servers (one batch group) and one dense table alone on one server.
TABLES = (
    TableSpec(name="user", num_rows=16, dim=DIM),
    TableSpec(name="item", num_rows=16, dim=DIM),
    TableSpec(name="tag", num_rows=16, dim=DIM),
    TableSpec(name="bias", num_rows=1, dim=DIM, kind="dense"),
)


@pytest.fixture(scope="module")
def job() -> Iterator[ps.PSJob]:
    options = ServerOptions(
        num_servers=2, seed=0, latency_ms=LATENCY_MS, rpc_timeout_s=10, start_timeout_s=30
    )
    with ps.local_job(TABLES, options) as job:
        yield job


class Recommender(nn.Module):
    """Fetches written where they are used, after the dense tower (as users write them)."""

    def __init__(self) -> None:
        super().__init__()
        self.bottom = nn.Sequential(nn.Linear(DIM, 16), nn.ReLU(), nn.Linear(16, DIM))
        self.top = nn.Linear(4 * DIM, 1)

    def forward(self, dense: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        h = self.bottom(dense)
        user = ps.fetch("user", ids[:, 0])
        item = ps.fetch("item", ids[:, 1])
        tag = ps.fetch("tag", ids[:, 2])
        bias = ps.fetch("bias", ids[:, 3] * 0)
        return self.top(torch.cat([h * user, item, tag, bias], dim=1))


def _inputs() -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(8, DIM), torch.randint(0, 16, (8, 4))


def _timed(module: nn.Module, inputs: tuple[torch.Tensor, ...], runs: int = 3) -> float:
    samples = []
    with torch.no_grad():
        for _ in range(runs):
            start = time.perf_counter()
            module(*inputs)
            samples.append(time.perf_counter() - start)
    return sorted(samples)[len(samples) // 2]


def test_fetches_are_batched_per_server_group_and_overlap_the_tower(job: ps.PSJob) -> None:
    model, inputs = Recommender(), _inputs()
    gm = distopt.optimize(model, inputs, passes=PASSES, verify=True, strict=True)
    ps.discard_step()
    batched = [n for n in gm.graph.nodes if n.target is ps.fetch_batched]
    assert len(batched) == 1
    assert [args[0] for args in batched[0].args[0]] == ["user", "item", "tag"]
    order = [n.name for n in gm.graph.nodes]
    assert order.index(batched[0].name) < order.index("bottom_0")
    # Gradients flow into the fetched rows (they are recorded for push_gradients).
    out = gm(*inputs)
    out.sum().backward()
    records = ps_context.take()
    assert {r.table for r in records} == {"user", "item", "tag", "bias"}
    assert all(r.rows.grad is not None for r in records if r.table != "bias")
    # 4 sequential round trips become 2 concurrent ones (one per server group).
    base, opt = _timed(model, inputs), _timed(gm, inputs)
    ps.discard_step()
    assert opt < 0.75 * base, (base, opt)


@pytest.mark.parametrize("batched", [False, True])
def test_server_error_is_raised_at_the_wait_with_the_users_line(
    job: ps.PSJob, batched: bool
) -> None:
    model, inputs = Recommender(), _inputs()
    passes = PASSES if batched else [p for p in PASSES if p != "batch_fetch"]
    gm = distopt.optimize(model, inputs, passes=passes, verify=False, strict=True)
    bad = inputs[1].clone()
    bad[0, 2] = 99  # row 99 of "tag" does not exist: the server rejects it
    with pytest.raises(distopt.RemoteCallError) as caught:
        gm(inputs[0], bad)
    ps.discard_step()
    message = str(caught.value)
    assert "table 'tag': row id 99" in message and "test_on_parameter_servers.py" in message
    # A batched request fails at its first wait, which quotes that call's line.
    line = 'user = ps.fetch("user", ids[:, 0])' if batched else 'tag = ps.fetch("tag", ids[:, 2])'
    assert line in message


def test_cost_model_predicts_the_measured_gain(job: ps.PSJob) -> None:
    model, inputs = Recommender(), _inputs()
    before = symbolic_capture(model, CaptureConfig())
    after = distopt.optimize(model, inputs, passes=PASSES, verify=False, strict=True)
    with torch.no_grad():  # each request timed as the model sends it
        prediction = predict(before, after, inputs, repeats=3)
    base, opt = _timed(before, inputs), _timed(after, inputs)
    ps.discard_step()
    assert prediction.before.requests == 4 and prediction.after.requests == 2
    assert prediction.before_s == pytest.approx(base, rel=0.35)
    assert prediction.after_s == pytest.approx(opt, rel=0.5)
