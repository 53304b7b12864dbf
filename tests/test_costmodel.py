import time

import pytest
import torch
from torch import nn

import distopt
from distopt.capture import symbolic_capture
from distopt.config import CaptureConfig
from distopt.costmodel import measure_latency, predict, profile_nodes, simulate
from tests.passes.remote import inprocess_server as ps
from tests.passes.remote.inprocess_server import STORE, fetch

PASSES = ["split_remote", "hoist_issue", "batch_fetch", "sink_wait"]


class Overlappable(nn.Module):
    """Two fetches (t0, t2: two servers) written right before their use, after a dense tower."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(ps.DIM, ps.DIM)
        self.fc2 = nn.Linear(ps.DIM, ps.DIM)

    def forward(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        h = self.fc2(torch.relu(self.fc1(x)))
        a = fetch("t0", ids)
        b = fetch("t2", ids)
        return h + a + b


@pytest.fixture(autouse=True)
def _fresh_store() -> None:
    STORE.reset()


def _graphs() -> tuple[torch.fx.GraphModule, torch.fx.GraphModule, tuple[torch.Tensor, ...]]:
    model = Overlappable()
    inputs = (torch.randn(3, ps.DIM), torch.tensor([1, 2, 3]))
    before = symbolic_capture(model, CaptureConfig())
    after = distopt.optimize(model, inputs, passes=PASSES, strict=True)
    return before, after, inputs


def _synthetic_costs(gm: torch.fx.GraphModule, seconds: float) -> dict[str, float]:
    return {n.name: seconds for n in gm.graph.nodes if n.op not in ("placeholder", "output")}


def test_blocking_graph_costs_compute_plus_every_latency() -> None:
    before, _, _ = _graphs()
    costs = _synthetic_costs(before, 0.001)
    local = [
        n
        for n in before.graph.nodes
        if n.op not in ("placeholder", "output") and n.target is not fetch
    ]
    timeline = simulate(before, costs, rpc_latency_s=0.010)
    assert timeline.requests == 2
    assert timeline.compute_s == pytest.approx(0.001 * len(local))
    assert timeline.total_s == pytest.approx(0.001 * len(local) + 2 * 0.010)
    assert timeline.blocked_s == pytest.approx(0.020)


def test_async_graph_hides_latency_behind_the_work_between_issue_and_wait() -> None:
    _, after, _ = _graphs()
    # Both fetches are issued first, the tower runs (3 nodes), then each wait precedes its add.
    assert [n.name for n in after.graph.nodes][2:10] == [
        "fetch_issue",
        "fetch_1_issue",
        "fc1",
        "relu",
        "fc2",
        "fetch_wait",
        "add",
        "fetch_1_wait",
    ]
    costs = _synthetic_costs(after, 0.001)  # remote nodes' own costs are ignored
    hidden = simulate(after, costs, rpc_latency_s=0.002)
    assert hidden.total_s == pytest.approx(0.005) and hidden.blocked_s == pytest.approx(0.0)
    exposed = simulate(after, costs, rpc_latency_s=0.050)
    assert exposed.total_s == pytest.approx(0.050 + 0.002)  # wait at 3 ms blocks until 50 ms
    assert exposed.blocked_s == pytest.approx(0.047)
    assert exposed.requests == 2 and exposed.compute_s == pytest.approx(0.005)


def test_profile_times_every_local_node_and_sends_one_step_to_the_server() -> None:
    before, _, inputs = _graphs()
    STORE.reset()
    costs = profile_nodes(before, inputs, repeats=3)
    local = {
        n.name
        for n in before.graph.nodes
        if n.op not in ("placeholder", "output") and n.target is not fetch
    }
    assert set(costs) == local
    assert all(c > 0 for c in costs.values())
    assert STORE.requests == 2  # the timed repetitions replay the recorded fetches


def test_prediction_before_and_after_the_passes() -> None:
    before, after, inputs = _graphs()
    latency = 0.005
    prediction = predict(before, after, inputs, rpc_latency_s=latency, repeats=3)
    assert prediction.unmatched == []
    assert prediction.before.requests == 2 and prediction.after.requests == 2
    assert prediction.before_s == pytest.approx(prediction.before.compute_s + 2 * latency)
    # The two fetches overlap each other and the tower: at most one latency remains.
    assert prediction.after_s <= prediction.after.compute_s + latency + 1e-9
    assert prediction.speedup > 1.5
    assert 0.5 <= prediction.hidden_fraction <= 1.0
    assert "predicted step" in prediction.summary()


def test_prediction_matches_a_measured_run_with_real_latency() -> None:
    before, after, inputs = _graphs()
    STORE.reset(delay_s=0.02)
    latency = measure_latency(lambda: fetch("t0", torch.tensor([0])), repeats=5)
    assert latency == pytest.approx(0.02, abs=0.015)

    def measured(gm: torch.fx.GraphModule) -> float:
        samples = []
        for _ in range(3):
            start = time.perf_counter()
            gm(*inputs)
            samples.append(time.perf_counter() - start)
        return sorted(samples)[1]

    prediction = predict(before, after, inputs, rpc_latency_s=latency, repeats=3)
    base, opt = measured(before), measured(after)
    assert prediction.before_s == pytest.approx(base, rel=0.5)
    assert prediction.after_s == pytest.approx(opt, rel=0.5)
    assert opt < base


def test_bad_latency_is_rejected() -> None:
    before, after, inputs = _graphs()
    with pytest.raises(distopt.ConfigError, match="rpc_latency_s"):
        predict(before, after, inputs, rpc_latency_s=-1.0)


def test_a_model_without_a_graph_is_a_one_line_error() -> None:
    before, _, inputs = _graphs()
    with pytest.raises(distopt.CaptureError, match=r"needs torch.fx graphs, got .* and Linear \(optimized\)$"):
        predict(before, nn.Linear(ps.DIM, ps.DIM), inputs, rpc_latency_s=0.001)
