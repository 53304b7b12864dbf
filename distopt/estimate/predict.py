"""Predict what the remote-call scheduling passes gain, from profiled node costs and RPC latency.

:func:`predict` says how long the forward graph takes before and after the passes: both graphs
walked by :func:`~distopt.estimate.timeline.simulate` with the node costs of one profiling run
(:func:`~distopt.estimate.profile.profile_nodes`; ``gm_after`` is profiled only when its local
nodes cannot be matched to ``gm_before``'s by name). Each remote request costs what the model's
own request took in that run, at the sizes the example inputs give — whatever serves it:
distopt's tables, the user's own ``rpc_sync`` functions, RRefs, Ray actors — unless the caller
gives one latency for all.

:class:`GainPrediction` is what the tools report (made by :func:`distopt.optimize.gain.predict_gain`,
which sits above this cost model because it captures the model with ``distopt.optimize``);
:meth:`GainPrediction.to_header` gives the QPS-log header keys (docs/qps_log_format.md).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx
from torch import nn

from distopt.errors import CaptureError, ConfigError
from distopt.estimate.profile import profile_nodes
from distopt.estimate.step import StepCosts, median_time
from distopt.estimate.timeline import RequestLatency, Timeline, simulate
from distopt.remote.ops import remote_ops
from distopt.remote.record import CALL_INDEX
from distopt.text import plural


def measure_latency(call: Callable[[], Any], *, repeats: int = 20) -> float:
    """Median seconds of ``call()`` after one warm-up call."""
    if repeats < 1:
        raise ConfigError(f"repeats: expected an integer >= 1, got {repeats!r}")
    return median_time(call, repeats=repeats)


@dataclass(frozen=True, slots=True)
class Prediction:
    """Predicted time of one forward step before and after the scheduling passes."""

    before: Timeline
    after: Timeline
    rpc_latency_s: float
    """A request's latency: the one given, else the median of the model's measured requests."""
    unmatched: list[str] = field(default_factory=list)
    """Nodes of ``gm_after`` whose cost came from profiling ``gm_after`` itself."""
    after_costs: dict[str, float] = field(default_factory=dict, repr=False)
    """Node costs ``after`` was simulated with (a pipelined step is simulated with them too)."""
    request_latency_s: dict[int, float] = field(default_factory=dict)
    """Measured seconds of each remote request of the model, by call position (none when a
    latency was given); requests not measured (writes) cost :attr:`rpc_latency_s`."""

    @property
    def latency(self) -> RequestLatency:
        return RequestLatency(self.rpc_latency_s, self.request_latency_s)

    @property
    def before_s(self) -> float:
        return self.before.total_s

    @property
    def after_s(self) -> float:
        return self.after.total_s

    @property
    def saving_s(self) -> float:
        return self.before_s - self.after_s

    @property
    def speedup(self) -> float:
        return self.before_s / self.after_s if self.after_s > 0 else float("inf")

    @property
    def hidden_fraction(self) -> float:
        """Share of the blocking remote time of ``before`` that ``after`` no longer waits for."""
        if self.before.blocked_s <= 0:
            return 0.0
        return max(0.0, (self.before.blocked_s - self.after.blocked_s) / self.before.blocked_s)

    def summary(self) -> str:
        return (
            f"predicted forward {self.before_s * 1e3:.2f} ms -> {self.after_s * 1e3:.2f} ms "
            f"({self.speedup:.2f}x; compute {self.after.compute_s * 1e3:.2f} ms, "
            f"{self.before.requests} -> {plural(self.after.requests, 'request')} of "
            f"{self.rpc_latency_s * 1e3:.2f} ms{' (median)' if len(self.request_latency_s) > 1 else ''}, "
            f"{self.hidden_fraction:.0%} of remote wait hidden)"
        )


def fx_graphs(**modules: nn.Module) -> list[torch.fx.GraphModule]:
    """The modules as torch.fx graphs, or a one-line error saying what they are instead (a model
    that fell back to eager or Dynamo has no nodes to cost)."""
    graphs = [m for m in modules.values() if isinstance(m, torch.fx.GraphModule)]
    if len(graphs) < len(modules):
        got = " and ".join(f"{type(m).__name__} ({role})" for role, m in modules.items())
        raise CaptureError(f"cost model: needs torch.fx graphs, got {got}")
    return graphs


def input_tuple(example_inputs: Any) -> tuple[Any, ...]:
    if isinstance(example_inputs, tuple):
        return example_inputs
    return tuple(example_inputs) if isinstance(example_inputs, list) else (example_inputs,)


def predict(
    gm_before: nn.Module,
    gm_after: nn.Module,
    example_inputs: tuple[Any, ...],
    rpc_latency_s: float | None = None,
    *,
    repeats: int = 5,
) -> Prediction:
    """Predict the forward time of ``gm_before`` (as captured) and ``gm_after`` (after the passes).

    Args:
        gm_before: the captured graph with blocking remote calls.
        gm_after: the optimized graph.
        example_inputs: positional inputs of one forward call.
        rpc_latency_s: seconds of every remote request; ``None``: each request costs what it
            took when profiling ``gm_before`` (its reads are sent, its writes never: they cost
            the median read).
        repeats: timed profiling runs per graph (the median is used).

    Both models must be torch.fx graphs: anything else is a one-line :class:`CaptureError`.
    """
    gm_before, gm_after = fx_graphs(captured=gm_before, optimized=gm_after)
    if rpc_latency_s is not None and not rpc_latency_s >= 0:
        raise ConfigError(f"rpc_latency_s: expected seconds >= 0, got {rpc_latency_s!r}")
    example_inputs = input_tuple(example_inputs)
    costs = profile_nodes(gm_before, example_inputs, repeats=repeats)
    before_ops = remote_ops(gm_before.graph)
    measured: dict[int, float] = {}
    if rpc_latency_s is None:
        for node, op in before_ops.items():
            index = node.meta.get(CALL_INDEX)
            if node is op.start and node.name in costs and isinstance(index, int):
                measured[index] = costs[node.name]
        rpc_latency_s = statistics.median(measured.values()) if measured else 0.0
    after_ops = remote_ops(gm_after.graph)
    local = [
        n.name
        for n in gm_after.graph.nodes
        if n not in after_ops and n.op not in ("placeholder", "output")
    ]
    unmatched = [name for name in local if name not in costs]
    after_costs = dict(costs)
    if unmatched:
        after_costs.update(profile_nodes(gm_after, example_inputs, repeats=repeats))
    latency = RequestLatency(rpc_latency_s, measured)
    return Prediction(
        before=simulate(gm_before, costs, latency),
        after=simulate(gm_after, after_costs, latency),
        rpc_latency_s=rpc_latency_s,
        unmatched=unmatched,
        after_costs=after_costs,
        request_latency_s=measured,
    )


@dataclass(frozen=True, slots=True)
class GainPrediction:
    """The predicted gain of an optimized model over the model as written, as the tools report it.

    Gradient pushes and DDP all-reduce are not modelled, so the gain is an upper bound;
    ``distopt compare`` takes :attr:`saving_s` off the baseline run's measured step instead.
    """

    forward: Prediction
    measured_step_s: float | None = None
    """Median forward+backward of the model as written; ``None`` when not measured."""
    measured_backward_s: float | None = None
    """Median backward of those runs (timed on its own); ``None`` when not measured."""
    costs: StepCosts | None = None
    """What a step of both models is made of, timed at start-up (:func:`distopt.estimate.step.predict_step`
    predicts the step from them); ``None`` when not measured."""
    unmeasured_step: str | None = None
    """Why a step asked for was not measured (its backward sends a remote write)."""
    pipelined: Timeline | None = None
    """The optimized forward when a pipeline prefetched its reads (:func:`predict_pipelined`)."""
    pipeline_staleness: int | None = None

    @property
    def rpc_latency_s(self) -> float:
        return self.forward.rpc_latency_s

    @property
    def saving_s(self) -> float:
        """Predicted seconds per step the passes (and the pipeline, if any) save in the forward."""
        if self.pipelined is not None:
            return self.forward.before_s - self.pipelined.total_s
        return self.forward.saving_s

    @property
    def step_s(self) -> float | None:
        """Predicted optimized step: the measured step less the saving, never below the compute."""
        if self.measured_step_s is None:
            return None
        return max(self.measured_step_s - self.saving_s, self.forward.after.compute_s)

    @property
    def gain(self) -> float:
        """Measured step over predicted step; the forward's speedup when no step was measured."""
        step = self.step_s
        if self.measured_step_s is None or step is None:
            after = self.pipelined.total_s if self.pipelined is not None else self.forward.after_s
            return self.forward.before_s / after if after > 0 else float("inf")
        return self.measured_step_s / step if step > 0 else float("inf")

    def to_header(self) -> dict[str, float]:
        """The QPS-log header keys (``predicted_step_time_s`` only when a step was measured)."""
        header = {"predicted_gain": self.gain}
        if self.step_s is not None:
            header["predicted_step_time_s"] = self.step_s
        header["predicted_saving_s"] = self.saving_s
        header["predicted_rpc_latency_s"] = self.rpc_latency_s
        if self.pipeline_staleness is not None:
            header["predicted_pipeline_staleness"] = self.pipeline_staleness
        return header


def pipeline_window_s(forward: Prediction, measured_step_s: float | None, staleness: int) -> float:
    """How much earlier than within one step a pipeline sends a batch's reads.

    Exact mode sends them after the previous step's pushes, so only that step's optimizer update
    (not modelled: 0) is gained. With ``staleness`` s >= 1 they are issued before the previous
    step's backward and s − 1 whole steps before that, but a table's read leaves only once the
    push issued before it is done (:mod:`distopt.ps.ordering`), one latency after the step before
    ended: the window is ``s·step − max(forward, latency)``. Backward is the measured
    forward+backward less the predicted forward of the model as written (the forward's compute
    when nothing was measured).
    """
    if staleness == 0:
        return 0.0
    if measured_step_s is None:
        backward = forward.before.compute_s
    else:
        backward = max(0.0, measured_step_s - forward.before_s)
    step = forward.after_s + backward
    return max(0.0, staleness * step - max(forward.after_s, forward.rpc_latency_s))


LATENCY_COVER = 2.0
"""How many request latencies a prefetch window must cover. One is the ideal, but the window
model times requests on an idle host and places the previous push at the step's start: with a
window of one latency, reads came back late on their jitter (ps_overlap, K = 1, light: staleness
1 ran at 0.87x no_network at 1 ms and staleness 2 at 0.91x at 5 ms; one step more gave 1.00x and
0.96x)."""


def staleness_to_hide(forward: Prediction, measured_step_s: float | None, *, limit: int) -> int:
    """The smallest staleness s >= 1 whose :func:`pipeline_window_s` covers ``LATENCY_COVER``
    request latencies (so prefetched reads are back before the step needs them), at most ``limit``."""
    for staleness in range(1, limit + 1):
        if (
            pipeline_window_s(forward, measured_step_s, staleness)
            >= LATENCY_COVER * forward.rpc_latency_s
        ):
            return staleness
    return limit
