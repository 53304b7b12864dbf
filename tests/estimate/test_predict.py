"""predict (forward before/after the passes) and predict_gain (what the tools report)."""

from __future__ import annotations

import time

import pytest
import torch
import torch.fx
from torch import nn

import distopt
from distopt.estimate.predict import (
    GainPrediction,
    Prediction,
    measure_latency,
    predict,
)
from distopt.estimate.step import OTHER, StepCosts, predict_step
from distopt.estimate.timeline import Timeline
from distopt.optimize import gain
from distopt.optimize.gain import REHEARSAL_ROUNDS, predict_gain, step_of
from tests.estimate.remote_models import IssuesPushInBackward, PushesInBackward, graphs, inputs
from tests.passes.remote import inprocess_server as ps
from tests.passes.remote.inprocess_server import STORE, fetch

HEADER_KEYS = [
    "predicted_gain",
    "predicted_step_time_s",
    "predicted_saving_s",
    "predicted_rpc_latency_s",
]


def test_prediction_before_and_after_the_passes() -> None:
    _, before, after, inputs = graphs()
    latency = 0.005
    prediction = predict(before, after, inputs, rpc_latency_s=latency, repeats=3)
    assert prediction.unmatched == []
    assert prediction.before.requests == 2 and prediction.after.requests == 2
    assert prediction.before_s == pytest.approx(prediction.before.compute_s + 2 * latency)
    # The two fetches overlap each other and the tower: at most one latency remains.
    assert prediction.after_s <= prediction.after.compute_s + latency + 1e-9
    assert prediction.speedup > 1.5
    assert 0.5 <= prediction.hidden_fraction <= 1.0
    assert "predicted forward" in prediction.summary()


def test_prediction_matches_a_measured_run_with_real_latency() -> None:
    _, before, after, inputs = graphs()
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
    _, before, after, inputs = graphs()
    with pytest.raises(distopt.ConfigError, match="rpc_latency_s"):
        predict(before, after, inputs, rpc_latency_s=-1.0)


def test_a_model_without_a_graph_is_a_one_line_error() -> None:
    _, before, _, inputs = graphs()
    with pytest.raises(
        distopt.CaptureError, match=r"needs torch.fx graphs, got .* and Linear \(optimized\)$"
    ):
        predict(before, nn.Linear(ps.DIM, ps.DIM), inputs, rpc_latency_s=0.001)


def _timeline(total_s: float, compute_s: float) -> Timeline:
    return Timeline(total_s=total_s, compute_s=compute_s, blocked_s=total_s - compute_s, requests=1)


def test_gain_takes_the_forward_saving_off_the_measured_step() -> None:
    forward = Prediction(
        before=_timeline(0.030, 0.005), after=_timeline(0.010, 0.005), rpc_latency_s=0.02
    )
    stepped = GainPrediction(forward=forward, measured_step_s=0.050)
    assert stepped.saving_s == pytest.approx(0.020) and stepped.step_s == pytest.approx(0.030)
    assert stepped.gain == pytest.approx(0.050 / 0.030)
    assert list(stepped.to_header()) == HEADER_KEYS
    assert stepped.to_header()["predicted_rpc_latency_s"] == 0.02
    # A step shorter than the saving (noise) is never predicted below the optimized compute.
    assert GainPrediction(forward=forward, measured_step_s=0.001).step_s == pytest.approx(0.005)
    forward_only = GainPrediction(forward=forward)
    assert forward_only.gain == pytest.approx(3.0) and forward_only.step_s is None
    assert "predicted_step_time_s" not in forward_only.to_header()


def test_predict_gain_leaves_the_model_as_it_was(monkeypatch) -> None:
    # Chunks of their minimum steps and no rounds past the first three (a settling rehearsal
    # goes on while the gain moves between rounds), so that the requests can be counted.
    monkeypatch.setattr(gain, "REHEARSAL_CHUNK_S", 0.0)
    monkeypatch.setattr(gain, "REHEARSAL_MAX_ROUNDS", REHEARSAL_ROUNDS)
    model, _, after, inputs = graphs()
    STORE.reset()
    rng = torch.random.get_rng_state()
    prediction = predict_gain(model, after, inputs, latency_s=0.004, measure_step=True, repeats=2)
    assert prediction.rpc_latency_s == 0.004 and prediction.measured_step_s is not None
    assert list(prediction.to_header()) == HEADER_KEYS
    assert prediction.forward.before.requests == 2 and prediction.forward.unmatched == []
    assert all(p.grad is None for p in model.parameters())
    assert torch.equal(torch.random.get_rng_state(), rng)
    # The captured graph's two reads in each of its 3 profiling runs, and in every rehearsed step
    # of both models: 3 rounds of a chunk of 2 steps (the first not counted) each.
    assert REHEARSAL_ROUNDS == 3
    assert STORE.requests == 2 * 3 + REHEARSAL_ROUNDS * 2 * 2 * 2


class _SlowSGD(torch.optim.SGD):
    """SGD that takes 3 ms a step and counts its steps."""

    steps = 0

    def step(self, closure=None):
        time.sleep(0.003)
        type(self).steps += 1
        return super().step(closure)


def _predicted_with_slow_sgd(model, after, inputs) -> GainPrediction:
    return predict_gain(
        model,
        after,
        inputs,
        latency_s=0.001,
        measure_step=True,
        repeats=2,
        optimizer=lambda params: _SlowSGD(params, lr=1.0),
    )


def test_the_rehearsed_step_ends_in_the_jobs_optimizer_step_on_copies(monkeypatch) -> None:
    """Each rehearsed step steps the job's optimizer, on copies of the parameters with that
    step's gradients: its cost is in the step where the job pays it, and the model's parameters,
    grads and optimizer state are as they were."""
    monkeypatch.setattr(gain, "REHEARSAL_CHUNK_S", 0.0)
    monkeypatch.setattr(gain, "REHEARSAL_MAX_ROUNDS", REHEARSAL_ROUNDS)
    model, _, after, inputs = graphs()
    STORE.reset()
    before = {name: p.detach().clone() for name, p in after.named_parameters()}
    _SlowSGD.steps = 0
    prediction = _predicted_with_slow_sgd(model, after, inputs)
    assert _SlowSGD.steps == REHEARSAL_ROUNDS * 2 * 2  # 2 schedules, chunks of 2 steps
    assert prediction.costs is not None
    for schedule in ("baseline", "optimized"):
        rehearsed = prediction.costs.rehearsed[schedule]
        assert rehearsed["optimizer"] >= 0.003
        # The optimizer is a phase of the rehearsed step, not left in ``other``.
        assert rehearsed[OTHER] < 0.003
    assert all(torch.equal(p, before[name]) for name, p in after.named_parameters())
    assert all(p.grad is None for p in after.parameters())
    step = step_of(prediction)
    assert step is not None and step.optimized["optimizer"] >= 0.003
    assert "copies of the parameters" in step.assumptions["optimizer"]


def test_no_optimizer_step_is_rehearsed_when_its_copies_would_not_fit(monkeypatch) -> None:
    """Copies of the parameters and the optimizer's state must fit in half the free memory: a
    prediction never runs a job out of memory. Without them the step has no optimizer phase."""
    monkeypatch.setattr(gain, "REHEARSAL_CHUNK_S", 0.0)
    monkeypatch.setattr(gain, "memory_available", lambda: 1024)
    model, _, after, inputs = graphs()
    STORE.reset()
    _SlowSGD.steps = 0
    prediction = _predicted_with_slow_sgd(model, after, inputs)
    assert _SlowSGD.steps == 0 and prediction.costs is not None
    assert "optimizer" not in prediction.costs.rehearsed["optimized"]
    step = step_of(prediction)
    assert step is not None and step.optimized["optimizer"] == 0.0
    assert step.assumptions["optimizer"].startswith("0: not rehearsed")


def test_predict_gain_sends_nothing_when_there_is_no_graph() -> None:
    model, _, _, inputs = graphs()
    STORE.reset()
    with pytest.raises(distopt.CaptureError, match=r"got Linear \(optimized\)$"):
        predict_gain(model, nn.Linear(ps.DIM, ps.DIM), inputs, measure_step=True)
    assert STORE.requests == 0


def test_each_request_costs_what_the_models_own_request_took() -> None:
    """No tables of distopt's and no latency given: the model's own requests are timed, each
    at the sizes it sends (here t2 answers slower than t0)."""
    model, _, after, inputs = graphs()
    STORE.reset(delay_s=0.02)
    prediction = predict_gain(model, after, inputs, repeats=2).forward
    assert sorted(prediction.request_latency_s) == [0, 1]
    assert all(0.02 <= s < 0.1 for s in prediction.request_latency_s.values())
    assert prediction.rpc_latency_s == pytest.approx(0.02, abs=0.02)
    assert prediction.before_s >= prediction.before.compute_s + 0.04  # two blocking round trips
    assert prediction.after_s < prediction.before_s - 0.015  # they overlap each other


def test_other_is_what_the_phase_medians_leave_of_the_median_step() -> None:
    """Steps long in their forward or in their push, and short ones: each phase's median is
    1 ms, the median step 11 ms; the 9 ms between is ``other``, part of the predicted step."""
    times = {
        "forward": [0.010, 0.001, 0.001],
        "waits": [0.0, 0.0, 0.0],
        "backward": [0.0, 0.0, 0.0],
        "pushes": [0.001, 0.010, 0.001],
        "step": [0.011, 0.011, 0.002],
    }
    assert gain.left_over(times) == pytest.approx(0.009)
    rehearsed = {"forward": 0.001, "waits": 0.0, "backward": 0.0, "pushes": 0.001, OTHER: 0.009}
    costs = StepCosts(rehearsed={s: rehearsed for s in ("baseline", "optimized")})
    assert predict_step(costs).optimized_s == pytest.approx(0.011)


def test_a_write_in_backward_is_waited_out_not_sent() -> None:
    """The user's own push in backward: the rehearsed step waits the model's median read
    instead of sending it, so the step is predicted and the table never changes."""
    model, example = PushesInBackward(), inputs()
    STORE.reset(delay_s=0.01)
    before = STORE.snapshot()
    optimized = distopt.optimize(
        model, example, passes=["split_remote", "hoist_issue", "sink_wait"]
    )
    prediction = predict_gain(model, optimized, example, measure_step=True, repeats=2)
    assert prediction.unmeasured_step is None and prediction.costs is not None
    # The in-process store's push has no stand-in to send (rpc_sync's has): waited out.
    assert prediction.costs.writes_not_applied == 1 and prediction.costs.writes_waited_out == 1
    assert prediction.costs.read_latency_s == prediction.rpc_latency_s >= 0.01
    # The waited-out write is in the backward of both schedules.
    for schedule in ("baseline", "optimized"):
        assert prediction.costs.rehearsed[schedule]["backward"] >= 0.01
    step = step_of(prediction)
    assert step is not None and "waited out" in step.assumptions["backward"]
    assert torch.equal(STORE.snapshot()["t1"], before["t1"])  # verified, predicted: never pushed


def test_an_issued_write_in_backward_answers_later_and_is_not_sent() -> None:
    """The write issued as a future (``push_async(...).wait()``): the rehearsal hands back a
    future that answers after the median read, so its wait costs what the write would."""
    model, example = IssuesPushInBackward(), inputs()
    STORE.reset(delay_s=0.01)
    before = STORE.snapshot()
    optimized = distopt.optimize(
        model, example, passes=["split_remote", "hoist_issue", "sink_wait"]
    )
    prediction = predict_gain(model, optimized, example, measure_step=True, repeats=2)
    assert prediction.costs is not None and prediction.costs.writes_not_applied == 1
    assert prediction.costs.rehearsed["baseline"]["backward"] >= 0.01
    assert torch.equal(STORE.snapshot()["t1"], before["t1"])


def test_predict_gain_refuses_a_bad_pipeline_staleness_before_any_request() -> None:
    model, _, after, inputs = graphs()
    STORE.reset()
    with pytest.raises(
        distopt.ConfigError,
        match=r"^pipeline_staleness: expected an integer >= 0 or 'auto', got -1$",
    ):
        predict_gain(model, after, inputs, latency_s=0.004, pipeline_staleness=-1)
    assert STORE.requests == 0


def test_predict_gain_reports_the_staleness_it_chose() -> None:
    model, _, after, inputs = graphs()
    prediction = predict_gain(
        model,
        after,
        inputs,
        latency_s=0.004,
        measure_step=True,
        repeats=2,
        pipeline_staleness="auto",
        max_staleness=3,
    )
    assert prediction.pipeline_staleness in (1, 2, 3)
    assert prediction.to_header()["predicted_pipeline_staleness"] == prediction.pipeline_staleness


def _rounds(*gains: float) -> dict[str, list[list[float]]]:
    """Rehearsal rounds whose baseline steps take 10 ms and whose optimized steps give ``gains``."""
    return {
        "baseline": [[0.010] * 5 for _ in gains],
        "optimized": [[0.010 / g] * 5 for g in gains],
    }


def test_a_settling_rehearsal_runs_rounds_until_the_gain_is_known() -> None:
    started = gain.now()
    assert gain.REHEARSAL_ROUNDS == 3 and gain.REHEARSAL_SETTLE_ROUNDS == 6
    assert not gain._settled(_rounds(2.0, 2.0), settle=False, started=started)  # 3 at least
    assert gain._settled(_rounds(2.0, 1.7, 2.0), settle=False, started=started)
    # Settling: three rounds that agree may sit in one of the host's spells; 6 at least.
    assert not gain._settled(_rounds(*[2.0] * 5), settle=True, started=started)
    assert gain._settled(_rounds(*[2.0] * 6), settle=True, started=started)
    # Gains of 1.7 to 2.3 from round to round: not known within ±5% after six rounds.
    assert not gain._settled(_rounds(2.0, 1.7, 2.3), settle=True, started=started)
    moving = _rounds(*[2.0, 1.7, 2.3] * 2)
    assert not gain._settled(moving, settle=True, started=started)
    # More rounds of the same spread narrow it: a 90% interval of about ±3% of the middle.
    assert gain._settled(_rounds(*[2.0, 1.96, 2.04] * 3), settle=True, started=started)
    # Never more than REHEARSAL_MAX_ROUNDS rounds or REHEARSAL_MAX_S seconds.
    many = _rounds(*[2.0, 1.7, 2.3] * gain.REHEARSAL_MAX_ROUNDS)
    assert gain._settled(many, settle=True, started=started)
    late = started - gain.REHEARSAL_MAX_S
    assert gain._settled(moving, settle=True, started=late)
    assert gain._settled(_rounds(2.0, 2.0, 2.0), settle=True, started=late)  # fewer than 6


def test_a_pipeline_is_rehearsed_in_the_same_rounds_as_the_model(monkeypatch) -> None:
    """Its gain is a ratio of steps rehearsed side by side, every schedule in every round."""
    orders = []
    rehearse = gain.rehearse

    def recorded(*args, **kwargs):
        orders.append((kwargs.get("schedules", ("baseline", "optimized")), kwargs.get("settle")))
        return rehearse(*args, **kwargs)

    monkeypatch.setattr(gain, "rehearse", recorded)
    model, _, after, inputs = graphs()
    predict_gain(
        model, after, inputs, latency_s=0.004, measure_step=True, repeats=2, pipeline_staleness=1
    )
    # A pipeline cannot count this model's reads as stale (not distopt.ps reads): its rehearsal
    # ends in a ConfigError
    # (the three schedules' rehearsal of a DLRM: tests/ps/test_ray_backend.py).
    assert orders == [
        (("baseline", "optimized"), False),  # sizes the pipeline only
        (("baseline", "optimized", "pipelined"), True),
    ]


def test_rehearsed_steps_take_the_jobs_batches_in_turn(monkeypatch) -> None:
    """Every schedule's steps take the job's first batches one after the other, as its steps
    will (one batch repeated ran a pipelined step 7–17% short); without them, the example."""
    monkeypatch.setattr(gain, "REHEARSAL_CHUNK_S", 0.0)
    monkeypatch.setattr(gain, "REHEARSAL_MAX_ROUNDS", REHEARSAL_ROUNDS)
    seen: list[float] = []
    loss_of = gain._loss_of

    def recorded(view):
        loss = loss_of(view)

        def step(batch):
            seen.append(float(batch[0][0, 0]))
            return loss(batch)

        return step

    monkeypatch.setattr(gain, "_loss_of", recorded)
    model, _, after, example = graphs()
    batches = [(torch.full_like(example[0], float(i)), example[1]) for i in range(3)]
    STORE.reset()
    predict_gain(model, after, batches[0], latency_s=0.001, measure_step=True, batches=batches)
    assert seen and set(seen) == {0.0, 1.0, 2.0}
    # In turn: each step the batch after the last (a chunk starts again where it likes).
    assert sum(b != (a + 1) % 3 for a, b in zip(seen, seen[1:], strict=False)) < len(seen) // 3
    seen.clear()
    predict_gain(model, after, example, latency_s=0.001, measure_step=True)
    assert seen and set(seen) == {float(example[0][0, 0])}


def test_a_job_reads_ahead_what_its_rehearsal_holds_and_trains_on_every_batch(
    monkeypatch,
) -> None:
    """Up to REHEARSAL_BATCHES batches, the first included, while their bytes fit, and no more
    than the job takes; every batch read is handed back, in order."""
    stream = iter(range(1000))
    ahead, fit = gain.read_ahead(stream, lambda batch: 1)
    assert ahead == list(range(gain.REHEARSAL_BATCHES - 1)) and fit == len(ahead)
    assert next(stream) == gain.REHEARSAL_BATCHES - 1  # nothing read past them
    stream = iter(range(1000))
    assert gain.read_ahead(stream, lambda batch: 1, most=3) == ([0, 1, 2], 3)  # a short job
    assert next(stream) == 3
    assert gain.read_ahead(iter(range(10)), lambda batch: 1, most=-1) == ([], 0)
    monkeypatch.setattr(gain, "REHEARSAL_BATCHES_BYTES", 25)
    stream = iter(range(100))
    ahead, fit = gain.read_ahead(stream, lambda batch: 10)
    assert ahead == [0, 1, 2] and fit == 2  # the third was read to learn it does not fit
    assert next(stream) == 3
    assert gain.read_ahead(iter([]), lambda batch: 1) == ([], 0)
