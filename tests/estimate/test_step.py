"""The step phase by phase: measured by the trainer (StepPhases), predicted (predict_step)."""

from __future__ import annotations

import dataclasses
import time

import pytest
import torch
from torch import nn

from distopt.estimate.predict import GainPrediction, Prediction
from distopt.estimate.step import (
    LOGGED,
    OTHER,
    PHASES,
    REPORTED,
    StepCosts,
    StepPhases,
    StepPrediction,
    gradient_bytes,
    predict_phases,
    predict_step,
)
from distopt.estimate.timeline import Timeline
from distopt.optimize.gain import step_of


class FakeWaits:
    """A remote client's wait counter: ``blocked(s)`` adds seconds, reading resets it."""

    def __init__(self) -> None:
        self.pending = 0.0

    def blocked(self, seconds: float) -> None:
        self.pending += seconds

    def __call__(self) -> float:
        taken, self.pending = self.pending, 0.0
        return taken


def test_phases_add_up_and_waits_belong_to_the_forward() -> None:
    waits = FakeWaits()
    phases = StepPhases(waits)
    waits.blocked(0.5)  # before the step: no phase, but the step's wait_s
    with phases.phase("data"):
        time.sleep(0.002)
    with phases.phase("forward"):
        waits.blocked(0.25)
        time.sleep(0.002)
    with phases.phase("pushes"):
        waits.blocked(0.125)  # a blocking push waits too, but not in the forward
    taken = phases.take()
    assert list(taken) == list(LOGGED)
    assert taken["data"] >= 0.002 and taken["forward"] >= 0.002
    assert taken["waits"] == 0.25
    assert taken["backward"] == taken["all_reduce"] == taken["optimizer"] == 0.0
    assert phases.take_waited() == 0.875
    assert phases.take() == dict.fromkeys(LOGGED, 0.0)  # the next step starts from zero
    with pytest.raises(ValueError, match="got 'fetch'"):
        with phases.phase("fetch"):
            pass


def test_backward_and_its_all_reduce_part() -> None:
    model = nn.Linear(8, 1)
    phases = StepPhases()
    loss = model(torch.randn(4, 8)).sum()
    with phases.backward(loss):
        loss.backward()
        time.sleep(0.003)  # after autograd's local work: what an all-reduce wait looks like
    taken = phases.take()
    assert model.weight.grad is not None
    assert 0.003 <= taken["all_reduce"] <= taken["backward"]
    # Outside a timed backward, a backward of the same graph records nothing.
    loss = model(torch.randn(4, 8)).sum()
    with phases.backward(loss):
        pass
    loss.backward()
    assert phases.take()["all_reduce"] == 0.0


def _rehearsed(forward: float, waits: float, pushes: float) -> dict[str, float]:
    return {
        "forward": forward,
        "waits": waits,
        "backward": 0.006,
        "all_reduce": 0.002,
        "pushes": pushes,
        "optimizer": 0.001,
    }


def test_predict_step_adds_the_jobs_own_parts_to_the_rehearsed_phases() -> None:
    costs = StepCosts(
        rehearsed={
            "baseline": _rehearsed(0.030, 0.028, 0.013),
            "optimized": _rehearsed(0.010, 0.008, 0.013),
        },
        pushes="in_turn",
        trainers=2,
        all_reduce_bytes=4096,
    )
    step = predict_step(costs)
    assert list(step.baseline) == list(REPORTED) == list(step.optimized)
    # The trainers rehearsed together: their turns to push and the all-reduce are as rehearsed.
    assert step.baseline["pushes"] == pytest.approx(0.013)
    assert step.baseline["backward"] == pytest.approx(0.006)  # the all-reduce is inside it
    assert step.baseline["all_reduce"] == pytest.approx(0.002)
    assert step.baseline_s == pytest.approx(0.030 + 0.006 + 0.013 + 0.001)
    assert step.optimized_s == pytest.approx(0.010 + 0.006 + 0.013 + 0.001)
    assert "copies of the parameters" in step.assumptions["optimizer"]
    assert step.gain == pytest.approx(step.baseline_s / step.optimized_s)
    header = step.to_header()
    assert header["predicted_saving_s"] == pytest.approx(0.020)
    assert header["predicted_gain"] == step.gain
    assert set(header["predicted_phases"]) == {"baseline", "optimized", "how"}
    how = header["predicted_phases"]["how"]
    assert set(how) == set(REPORTED)
    assert "one after the other" in how["pushes"] and "2 trainers in step" in how["pushes"]
    assert "4,096 dense gradient bytes" in how["all_reduce"]
    # Asynchronous pushes cost what the rehearsal measured: sending them.
    sent = predict_step(dataclasses.replace(costs, pushes="async"))
    assert sent.optimized["pushes"] == 0.013 and "dry-run" in sent.assumptions["pushes"]
    alone = predict_step(dataclasses.replace(costs, trainers=1, all_reduce_bytes=0))
    assert alone.assumptions["all_reduce"].startswith("0: no gradient all-reduce")


def test_predict_phases_of_a_schedule_not_rehearsed_is_an_error() -> None:
    costs = StepCosts(rehearsed={"baseline": _rehearsed(0.03, 0.02, 0.0)})
    assert predict_phases(costs, "baseline")["forward"] == 0.03
    with pytest.raises(KeyError):
        predict_phases(costs, "pipelined")


def test_step_total_is_the_disjoint_phases_and_other() -> None:
    phases = {"data": 1.0, "forward": 2.0, "waits": 1.5, "backward": 3.0, "all_reduce": 2.5}
    assert StepPrediction.total({**phases, "pushes": 4.0, "optimizer": 5.0}) == 15.0
    assert StepPrediction.total({**phases, "pushes": 4.0, "optimizer": 5.0, OTHER: 0.5}) == 15.5
    assert set(PHASES) | {"waits", "all_reduce"} == set(LOGGED)
    assert REPORTED == (*LOGGED, OTHER)


def test_a_step_rehearsed_without_the_jobs_optimizer_predicts_none() -> None:
    rehearsed = {"forward": 0.01, "waits": 0.0, "backward": 0.01, "pushes": 0.0}
    step = predict_step(StepCosts(rehearsed={s: rehearsed for s in ("baseline", "optimized")}))
    assert step.baseline["optimizer"] == 0.0
    assert step.assumptions["optimizer"].startswith("0: not rehearsed")


def test_a_loader_without_workers_adds_its_reads_to_every_schedules_data() -> None:
    rehearsed = {"forward": 0.01, "waits": 0.0, "backward": 0.01, "pushes": 0.0}
    costs = StepCosts(rehearsed={s: rehearsed for s in ("baseline", "optimized")})
    kept_up = predict_step(costs)
    assert kept_up.baseline["data"] == kept_up.optimized["data"] == 0.0
    assert "the loader keeps up" in kept_up.assumptions["data"]
    read = predict_step(dataclasses.replace(costs, data_s=0.0025))
    assert read.baseline["data"] == read.optimized["data"] == 0.0025
    assert read.baseline_s == kept_up.baseline_s + 0.0025
    assert "2.50 ms of reading it" in read.assumptions["data"]


def test_gradient_bytes_are_the_trainable_parameters() -> None:
    model = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 1))
    model[1].bias.requires_grad_(False)
    assert gradient_bytes(model) == (16 * 16 + 16 + 16) * 4


def test_step_of_a_gain_prediction_uses_the_pipelined_rehearsal() -> None:
    before = Timeline(total_s=0.030, compute_s=0.002, blocked_s=0.028, requests=4)
    after = Timeline(total_s=0.010, compute_s=0.002, blocked_s=0.008, requests=1)
    forward = Prediction(before=before, after=after, rpc_latency_s=0.007)
    assert step_of(GainPrediction(forward=forward)) is None
    costs = StepCosts(
        rehearsed={
            "baseline": _rehearsed(0.030, 0.028, 0.007),
            "optimized": _rehearsed(0.010, 0.008, 0.007),
            "pipelined": _rehearsed(0.003, 0.001, 0.001),
        },
        pushes="blocking",
    )
    gain = GainPrediction(forward=forward, costs=costs, pipeline_staleness=2)
    step = step_of(gain)
    assert step is not None
    assert step.baseline["forward"] == 0.030 and step.optimized["forward"] == 0.003
    assert step.optimized["waits"] == 0.001 and step.baseline["pushes"] == 0.007
    assert step.baseline["backward"] == 0.006 and step.optimized["optimizer"] == 0.001
