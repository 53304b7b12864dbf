"""simulate: one clock over a graph, blocking calls vs issues whose waits come later."""

import pytest
import torch.fx

from distopt.estimate.timeline import simulate
from tests.estimate.remote_models import graphs, local_nodes


def _synthetic_costs(gm: torch.fx.GraphModule, seconds: float) -> dict[str, float]:
    return {n.name: seconds for n in gm.graph.nodes if n.op not in ("placeholder", "output")}


def test_blocking_graph_costs_compute_plus_every_latency() -> None:
    _, before, _, _ = graphs()
    costs = _synthetic_costs(before, 0.001)
    local = local_nodes(before)
    timeline = simulate(before, costs, rpc_latency_s=0.010)
    assert timeline.requests == 2
    assert timeline.compute_s == pytest.approx(0.001 * len(local))
    assert timeline.total_s == pytest.approx(0.001 * len(local) + 2 * 0.010)
    assert timeline.blocked_s == pytest.approx(0.020)


def test_async_graph_hides_latency_behind_the_work_between_issue_and_wait() -> None:
    _, _, after, _ = graphs()
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


def test_issues_sent_a_step_ahead_start_with_a_head_start() -> None:
    _, _, after, _ = graphs()
    costs = _synthetic_costs(after, 0.001)
    early = {"fetch_issue": 0.048, "fetch_1_issue": 0.048}  # a pipeline sent them 48 ms earlier
    pipelined = simulate(after, costs, rpc_latency_s=0.050, head_start_s=early)
    assert pipelined.blocked_s == pytest.approx(0.0) and pipelined.total_s == pytest.approx(0.005)
    partly = simulate(after, costs, rpc_latency_s=0.050, head_start_s={"fetch_issue": 0.040})
    # The first is ready at 10 ms (7 ms blocked at its wait), the other still at 50 ms (39 ms).
    assert partly.blocked_s == pytest.approx(0.007 + 0.039)


def test_the_pipelined_prediction_hides_what_the_window_covers() -> None:
    from distopt.estimate.predict import Prediction, pipeline_window_s
    from distopt.estimate.timeline import Timeline
    from distopt.optimize.gain import predict_pipelined

    _, before, after, _ = graphs()
    costs = _synthetic_costs(after, 0.001)
    forward = Prediction(
        before=simulate(before, costs, 0.050),
        after=simulate(after, costs, 0.050),
        rpc_latency_s=0.050,
        after_costs=costs,
    )
    # Exact mode gains only the unmodelled optimizer step; staleness 1 the backward too.
    assert pipeline_window_s(forward, measured_step_s=None, staleness=0) == 0.0
    step = forward.before_s + 0.030  # a measured forward+backward: 30 ms of backward
    assert pipeline_window_s(forward, step, staleness=1) == pytest.approx(0.030)
    assert pipeline_window_s(forward, step, staleness=2) == pytest.approx(
        0.030 + forward.after_s + 0.030
    )
    piped = predict_pipelined(after, forward, window_s=0.030)
    assert isinstance(piped, Timeline) and piped.blocked_s == pytest.approx(0.047 - 0.030)


def test_the_staleness_to_hide_is_the_least_whose_window_covers_the_latency() -> None:
    from distopt.estimate.predict import (
        LATENCY_COVER,
        Prediction,
        pipeline_window_s,
        staleness_to_hide,
    )

    _, before, after, _ = graphs()
    costs = _synthetic_costs(after, 0.001)
    forward = Prediction(
        before=simulate(before, costs, 0.050),
        after=simulate(after, costs, 0.050),
        rpc_latency_s=0.050,
        after_costs=costs,
    )
    # The window must cover LATENCY_COVER latencies (2 x 50 ms), not one: reads came back late on
    # their jitter with a window of exactly one latency.
    cover = LATENCY_COVER * 0.050
    step = forward.before_s + 0.030
    chosen = staleness_to_hide(forward, step, limit=8)
    assert (
        pipeline_window_s(forward, step, chosen - 1)
        < cover
        <= pipeline_window_s(forward, step, chosen)
    )
    long_backward = forward.before_s + 0.200
    assert pipeline_window_s(forward, long_backward, 1) >= cover
    assert staleness_to_hide(forward, long_backward, limit=8) == 1
    assert staleness_to_hide(forward, step, limit=1) == 1  # capped: the caller's bound wins


def test_a_read_waits_for_the_previous_push_so_a_long_latency_shrinks_the_window() -> None:
    """A table's prefetch leaves once the previous step's push is done (distopt.ps.client.ordering)."""
    import dataclasses

    from distopt.estimate.predict import (
        LATENCY_COVER,
        Prediction,
        pipeline_window_s,
        staleness_to_hide,
    )

    _, before, after, _ = graphs()
    costs = _synthetic_costs(after, 0.001)
    forward = Prediction(
        before=simulate(before, costs, 0.050),
        after=simulate(after, costs, 0.050),
        rpc_latency_s=0.050,
        after_costs=costs,
    )
    slow = dataclasses.replace(forward, rpc_latency_s=forward.after_s + 0.040)
    measured = slow.before_s + 0.030
    step = slow.after_s + 0.030
    assert pipeline_window_s(slow, measured, 1) == pytest.approx(
        max(0.0, step - slow.rpc_latency_s)
    )
    assert pipeline_window_s(slow, measured, 3) == pytest.approx(3 * step - slow.rpc_latency_s)
    chosen = staleness_to_hide(slow, measured, limit=8)
    assert pipeline_window_s(slow, measured, chosen - 1) < LATENCY_COVER * slow.rpc_latency_s
    assert pipeline_window_s(slow, measured, chosen) >= LATENCY_COVER * slow.rpc_latency_s
