"""TrainPipeline against a real parameter server: exact mode is bitwise the optimized model without
a pipeline; with staleness s, rows miss at most s updates (counted), and memory stays in bounds."""

from __future__ import annotations

import re

import pytest
import torch

import distopt.ps as ps
from distopt.errors import ConfigError
from distopt.estimate.step import LOGGED, StepPhases
from distopt.models.dlrm import dlrm_loss, make_batch
from distopt.pipeline import TrainPipeline
from distopt.pipeline.prefetch import LATE_TAKES
from distopt.ps.client import calls
from tests.pipeline.conftest import CONFIG, bitwise_equal, optimized_dlrm

STEPS = 8
LR = 0.5  # large, so a missed update shows in the losses


def _batches() -> list:
    return [make_batch(CONFIG, step) for step in range(STEPS)]


def _inputs(batch):
    return (batch.dense, batch.sparse)


def _loss(out, batch):
    return dlrm_loss(out, batch.labels)


def _sequential(server) -> tuple[list[float], dict, dict]:
    ps.load_state_dict(server)
    batches = _batches()
    gm = optimized_dlrm(_inputs(batches[0]))
    opt = torch.optim.Adam(gm.parameters(), lr=0.01)
    losses = []
    for batch in batches:
        opt.zero_grad(set_to_none=True)
        loss = _loss(gm(*_inputs(batch)), batch)
        loss.backward()
        ps.push_gradients(lr=LR)
        opt.step()
        losses.append(loss.item())
    ps.flush()
    return losses, gm.state_dict(), opt.state_dict()


def _pipelined(
    server, staleness: int, deterministic: bool = False
) -> tuple[list[float], dict, dict, TrainPipeline]:
    ps.load_state_dict(server)
    batches = _batches()
    gm = optimized_dlrm(_inputs(batches[0]))
    opt = torch.optim.Adam(gm.parameters(), lr=0.01)
    pipe = TrainPipeline(
        gm,
        opt,
        iter(batches),
        staleness=staleness,
        loss_fn=_loss,
        inputs=_inputs,
        push=lambda: ps.push_gradients(lr=LR),
        deterministic=deterministic,
    )
    losses = [out.loss.item() for out in pipe.run()]
    pipe.close()
    ps.flush()
    return losses, gm.state_dict(), opt.state_dict(), pipe


def test_exact_mode_is_bitwise_the_optimized_model_without_a_pipeline(server) -> None:
    losses, params, opt_state = _sequential(server)
    tables = ps.state_dict()
    p_losses, p_params, p_opt_state, pipe = _pipelined(server, staleness=0)
    assert p_losses == losses
    assert bitwise_equal(p_params, params) and bitwise_equal(p_opt_state, opt_state)
    assert bitwise_equal(ps.state_dict(), tables)  # rows and the servers' optimizer state
    assert pipe.stats.batches == STEPS and pipe.stats.staleness_max == 0 and pipe.stats.rows > 0


@pytest.mark.parametrize("staleness", [1, 2])
def test_rows_miss_at_most_staleness_updates_and_the_count_is_measured(server, staleness) -> None:
    losses, _, _ = _sequential(server)
    p_losses, _, _, pipe = _pipelined(server, staleness=staleness)
    stats = pipe.stats
    # 40 rows per table and 24 ids a batch: consecutive batches share rows, so updates are missed.
    assert stats.staleness_max == staleness and 0 < stats.staleness_mean < staleness
    assert p_losses[0] == losses[0] and p_losses != losses
    # Extra memory: prefetched rows waiting for their step, at most one batch's rows per stage.
    assert 0 < stats.batch_bytes_max
    assert stats.inflight_bytes_max <= staleness * stats.batch_bytes_max


def test_deterministic_stale_runs_repeat_bitwise_and_pushes_are_ordered_again_after(server) -> None:
    first_losses, first_params, _, first = _pipelined(server, staleness=1, deterministic=True)
    first_tables = ps.state_dict()
    losses, params, _, pipe = _pipelined(server, staleness=1, deterministic=True)
    assert losses == first_losses and bitwise_equal(params, first_params)
    assert bitwise_equal(ps.state_dict(), first_tables)
    assert pipe.stats.staleness_max == 1 == first.stats.staleness_max
    _pipelined(server, staleness=1)  # relaxed: pushes may overtake each other while it runs
    assert calls.set_stale_pushes(False) is False  # and the issue order is back after it


def test_a_pipeline_times_its_steps_phases_for_the_caller(server) -> None:
    ps.load_state_dict(server)
    batches = _batches()
    gm = optimized_dlrm(_inputs(batches[0]))
    phases = StepPhases(ps.take_wait_time)
    pipe = TrainPipeline(
        gm,
        torch.optim.SGD(gm.parameters(), lr=0.01),
        iter(batches),
        staleness=1,
        loss_fn=_loss,
        inputs=_inputs,
        push=lambda: ps.push_gradients(lr=LR),
        phases=phases,
    )
    taken = []
    for _ in pipe.run():
        taken.append(phases.take())
    pipe.close()
    ps.flush()
    assert len(taken) == STEPS
    for step in taken:
        assert list(step) == list(LOGGED)
        assert step["forward"] > 0 and step["backward"] > 0 and step["optimizer"] > 0
        assert step["pushes"] > 0 and step["data"] >= 0 and 0 <= step["waits"] <= step["forward"]


def test_the_data_ends_cleanly_between_steps(server) -> None:
    ps.load_state_dict(server)
    batches = _batches()[:3]
    gm = optimized_dlrm(_inputs(batches[0]))
    pipe = TrainPipeline(
        gm,
        torch.optim.SGD(gm.parameters(), lr=0.1),
        iter(batches),
        staleness=1,
        loss_fn=_loss,
        inputs=_inputs,
        push=lambda: ps.push_gradients(lr=LR),
    )
    steps = [pipe.progress().step for _ in range(3)]
    with pytest.raises(StopIteration):
        pipe.progress()
    assert steps == [0, 1, 2] and pipe.steps == 3
    assert len(list(pipe.run(max_steps=10))) == 0
    pipe.close()
    ps.flush()


@pytest.mark.parametrize("bad", [-1, 1.5, "1", True])
def test_a_bad_staleness_is_a_one_line_error(server, bad) -> None:
    batch = make_batch(CONFIG, 0)
    gm = optimized_dlrm(_inputs(batch))
    with pytest.raises(ConfigError, match=rf"^staleness: expected an integer >= 0, got {bad!r}$"):
        TrainPipeline(gm, torch.optim.SGD(gm.parameters(), lr=0.1), staleness=bad, loss_fn=_loss)


def test_late_prefetches_deepen_the_staleness_up_to_the_maximum(server) -> None:
    ps.set_latency_ms(40.0)  # every read answers long after a step of this small model
    try:
        batches = _batches() * 3
        ps.load_state_dict(server)
        gm = optimized_dlrm(_inputs(batches[0]))
        pipe = TrainPipeline(
            gm,
            torch.optim.SGD(gm.parameters(), lr=0.1),
            iter(batches),
            staleness=1,
            max_staleness=2,
            loss_fn=_loss,
            inputs=_inputs,
            push=lambda: ps.push_gradients(lr=LR),
        )
        depths = []
        for _ in pipe.run():
            depths.append(pipe.stats.depth)
        pipe.close()
        ps.flush()
    finally:
        ps.set_latency_ms(0.0)
    stats = pipe.stats
    assert depths[0] == 1 and depths[-1] == 2 and depths == sorted(depths)  # deepened, never past
    assert stats.late >= LATE_TAKES  # the deepening followed LATE_TAKES late batches in a row
    assert stats.staleness_max == 2  # counted as before: the rows now miss up to 2 updates


def test_a_fixed_staleness_stays_however_late_the_reads(server) -> None:
    ps.set_latency_ms(40.0)
    try:
        _, _, _, pipe = _pipelined(server, staleness=1)
    finally:
        ps.set_latency_ms(0.0)
    assert pipe.stats.late > 0 and pipe.stats.depth == 1 and pipe.stats.staleness_max <= 1


@pytest.mark.parametrize(
    ("staleness", "max_staleness", "deterministic", "message"),
    [
        (0, 2, False, "max_staleness: 2 needs staleness >= 1 (got 0)"),
        (2, 1, False, "max_staleness: 1 needs staleness >= 1 (got 2), at most max_staleness"),
        (1, 2, True, "deterministic off"),
    ],
)
def test_an_adapting_staleness_that_cannot_hold_is_a_one_line_error(
    server, staleness, max_staleness, deterministic, message
) -> None:
    batch = make_batch(CONFIG, 0)
    gm = optimized_dlrm(_inputs(batch))
    with pytest.raises(ConfigError, match=re.escape(message)) as info:
        TrainPipeline(
            gm,
            torch.optim.SGD(gm.parameters(), lr=0.1),
            staleness=staleness,
            max_staleness=max_staleness,
            deterministic=deterministic,
            loss_fn=_loss,
        )
    assert "\n" not in str(info.value)
