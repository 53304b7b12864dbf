"""``predict_gain``: what the tools report about an optimized model (the trainer's QPS-log header,
``distopt explain --ps-latency-ms``, the ps_overlap benchmark).

It captures the model as written (with :func:`distopt.optimize`, no passes), predicts the forward
before and after with the cost model of :mod:`distopt.estimate`, and optionally measures a
forward+backward of the model to turn the forward saving into a step gain. It lives here, above
the cost model, because it captures and because a pipelined prediction needs the pipeline's split.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
import torch.fx
from torch import nn

from distopt.errors import ConfigError
from distopt.estimate.predict import (
    GainPrediction,
    Prediction,
    fx_graphs,
    input_tuple,
    pipeline_window_s,
    predict,
    staleness_to_hide,
)
from distopt.estimate.step import StepPrediction, forward_backward_times, predict_step
from distopt.estimate.timeline import Timeline, simulate
from distopt.optimize.api import optimize
from distopt.pipeline.split import prefetchable
from distopt.remote.isolation import isolated, preserved_state
from distopt.remote.local import with_remote_calls
from distopt.remote.record import RemoteWriteRefused, recording


def predict_pipelined(
    optimized: torch.fx.GraphModule, forward: Prediction, window_s: float
) -> Timeline:
    """The optimized forward whose prefetchable reads were sent ``window_s`` earlier."""
    early = {issue.name: window_s for issue, _ in prefetchable(optimized)}
    return simulate(optimized, forward.after_costs, forward.latency, head_start_s=early)


def _measure_step(
    model: nn.Module, example_inputs: tuple[Any, ...], runs: int = 3
) -> tuple[float, float]:
    """Median seconds of a forward and of a backward of ``model`` (timed apart); its grads,
    buffers and RNG stream, and remote state such as fetched-row records, are as they were
    afterwards. Remote reads are sent; a remote write (a push in backward) raises
    :class:`RemoteWriteRefused` before it is sent."""
    view = with_remote_calls(model)
    with (
        preserved_state(model),
        isolated(),
        torch.random.fork_rng(devices=[]),
        recording(view, allow_writes=False),
    ):
        # Restored on exit; None now so that backward does not accumulate into the user's grads.
        model.zero_grad(set_to_none=True)
        return forward_backward_times(lambda: view(*example_inputs).float().sum(), repeats=runs)


def predict_gain(
    model: nn.Module,
    optimized: nn.Module,
    example_inputs: Any,
    *,
    latency_s: float | None = None,
    measure_step: bool = False,
    repeats: int = 5,
    pipeline_staleness: int | Literal["auto"] | None = None,
    max_staleness: int = 8,
) -> GainPrediction:
    """Predict the gain of ``optimized`` (a torch.fx graph distopt made) over ``model``.

    Args:
        model: the model as written; captured here without passes for the "before" graph.
        optimized: the optimized GraphModule.
        example_inputs: positional inputs of one forward call.
        latency_s: seconds per remote request; default: each request of the model measured
            (:func:`predict`), whatever serves it.
        measure_step: also time a forward+backward of ``model`` (the trainer's step gain); not
            done, and said in :attr:`GainPrediction.unmeasured_step`, when the step sends a
            remote write (it is never sent twice).
        repeats: timed profiling runs per graph.
        pipeline_staleness: also predict the step of a pipeline (:mod:`distopt.pipeline`)
            with this staleness; ``"auto"``: with the least that hides a request's latency
            (:func:`staleness_to_hide`, at most ``max_staleness``), reported in the result.

    A model or optimized model without a graph is a one-line :class:`CaptureError`, raised
    before any request is sent.
    """
    if latency_s is not None and not latency_s >= 0:
        raise ConfigError(f"latency_s: expected seconds >= 0, got {latency_s!r}")
    if not (
        pipeline_staleness in (None, "auto")
        or (isinstance(pipeline_staleness, int) and pipeline_staleness >= 0)
    ):
        raise ConfigError(
            f"pipeline_staleness: expected an integer >= 0 or 'auto', got {pipeline_staleness!r}"
        )
    fx_graphs(optimized=optimized)
    example_inputs = input_tuple(example_inputs)
    with torch.no_grad():
        captured = optimize(model, passes=[], verify=False)
    fx_graphs(captured=captured, optimized=optimized)
    forward = predict(captured, optimized, example_inputs, latency_s, repeats=repeats)
    step = backward = unmeasured = None
    if measure_step:
        try:
            forward_s, backward = _measure_step(model, example_inputs, runs=repeats)
            step = forward_s + backward
        except RemoteWriteRefused as err:
            unmeasured = f"the step sends a remote write ({err.write.describe()})"
    pipelined = None
    if pipeline_staleness == "auto":
        pipeline_staleness = staleness_to_hide(forward, step, limit=max_staleness)
    if pipeline_staleness is not None:
        window = pipeline_window_s(forward, step, pipeline_staleness)
        pipelined = predict_pipelined(optimized, forward, window)  # type: ignore[arg-type]
    return GainPrediction(
        forward=forward,
        measured_step_s=step,
        measured_backward_s=backward,
        unmeasured_step=unmeasured,
        pipelined=pipelined,
        pipeline_staleness=pipeline_staleness,
    )


def step_of(
    gain: GainPrediction,
    *,
    optimizer_s: float,
    all_reduce_s: float,
    num_trainers: int,
    blocking_pushes: bool,
    barrier_s: float = 0.0,
) -> StepPrediction | None:
    """:func:`predict_step` from a :func:`predict_gain` made with
    ``measure_step=True`` (``None`` when its step was not measured); a pipelined prediction's
    optimized forward is the pipelined one."""
    if gain.measured_backward_s is None:
        return None
    after = gain.pipelined if gain.pipelined is not None else gain.forward.after
    return predict_step(
        forward_before_s=gain.forward.before_s,
        forward_after_s=after.total_s,
        waits_before_s=gain.forward.before.blocked_s,
        waits_after_s=after.blocked_s,
        backward_s=gain.measured_backward_s,
        request_latency_s=gain.rpc_latency_s,
        optimizer_s=optimizer_s,
        all_reduce_s=all_reduce_s,
        num_trainers=num_trainers,
        blocking_pushes=blocking_pushes,
        barrier_s=barrier_s,
    )
