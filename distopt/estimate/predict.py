"""Predict what the remote-call scheduling passes gain, from profiled node costs and RPC latency.

:func:`predict` says how long the forward graph takes before and after the passes: both graphs
walked by :func:`~distopt.estimate.timeline.simulate` with the node costs of one profiling run
(:func:`~distopt.estimate.profile.profile_nodes`; ``gm_after`` is profiled only when its local
nodes cannot be matched to ``gm_before``'s by name). Each remote request costs what the model's
own request took in that run, at the sizes the example inputs give — whatever serves it:
distopt's tables, the user's own ``rpc_sync`` functions, RRefs, Ray actors — unless the caller
gives one latency for all.

:func:`predict_gain` is what the tools call (the trainer's QPS-log header, ``distopt explain
--ps-latency-ms``, the ps_overlap benchmark): it captures the model as written, predicts the
forward, and optionally measures a forward+backward of the model to turn the forward saving into
a step gain. :meth:`GainPrediction.to_header` gives the QPS-log header keys
(docs/qps_log_format.md).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.fx
from torch import nn

from distopt.errors import CaptureError, ConfigError
from distopt.estimate.profile import profile_nodes
from distopt.estimate.timeline import RequestLatency, Timeline, simulate
from distopt.optimize.verify import isolated, preserved_state
from distopt.remote.local import with_remote_calls
from distopt.remote.ops import remote_ops
from distopt.remote.record import CALL_INDEX, RemoteWriteRefused, recording
from distopt.text import plural


def measure_latency(call: Callable[[], Any], *, repeats: int = 20) -> float:
    """Median seconds of ``call()`` after one warm-up call."""
    if repeats < 1:
        raise ConfigError(f"repeats: expected an integer >= 1, got {repeats!r}")
    call()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


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
            f"predicted step {self.before_s * 1e3:.2f} ms -> {self.after_s * 1e3:.2f} ms "
            f"({self.speedup:.2f}x; compute {self.after.compute_s * 1e3:.2f} ms, "
            f"{self.before.requests} -> {plural(self.after.requests, 'request')} of "
            f"{self.rpc_latency_s * 1e3:.2f} ms{' (median)' if len(self.request_latency_s) > 1 else ''}, "
            f"{self.hidden_fraction:.0%} of remote wait hidden)"
        )


def _graphs(**modules: nn.Module) -> list[torch.fx.GraphModule]:
    """The modules as torch.fx graphs, or a one-line error saying what they are instead (a model
    that fell back to eager or Dynamo has no nodes to cost)."""
    graphs = [m for m in modules.values() if isinstance(m, torch.fx.GraphModule)]
    if len(graphs) < len(modules):
        got = " and ".join(f"{type(m).__name__} ({role})" for role, m in modules.items())
        raise CaptureError(f"cost model: needs torch.fx graphs, got {got}")
    return graphs


def _as_tuple(example_inputs: Any) -> tuple[Any, ...]:
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
    gm_before, gm_after = _graphs(captured=gm_before, optimized=gm_after)
    if rpc_latency_s is not None and not rpc_latency_s >= 0:
        raise ConfigError(f"rpc_latency_s: expected seconds >= 0, got {rpc_latency_s!r}")
    example_inputs = _as_tuple(example_inputs)
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


def predict_pipelined(
    optimized: torch.fx.GraphModule, forward: Prediction, window_s: float
) -> Timeline:
    """The optimized forward whose prefetchable reads were sent ``window_s`` earlier."""
    from distopt.pipeline.split import prefetchable  # the pipeline builds on the passes, as we do

    early = {issue.name: window_s for issue, _ in prefetchable(optimized)}
    return simulate(optimized, forward.after_costs, forward.latency, head_start_s=early)


def _measure_step(model: nn.Module, example_inputs: tuple[Any, ...], runs: int = 3) -> float:
    """Median seconds of a forward+backward of ``model``; its grads, buffers and RNG stream, and
    remote state such as fetched-row records, are as they were afterwards. Remote reads are sent;
    a remote write (a push in backward) raises :class:`RemoteWriteRefused` before it is sent."""
    samples = []
    view = with_remote_calls(model)
    with (
        preserved_state(model),
        isolated(),
        torch.random.fork_rng(devices=[]),
        recording(view, allow_writes=False),
    ):
        # Restored on exit; None now so that backward does not accumulate into the user's grads.
        model.zero_grad(set_to_none=True)
        for _ in range(runs):
            start = time.perf_counter()
            view(*example_inputs).float().sum().backward()
            samples.append(time.perf_counter() - start)
    return statistics.median(samples)


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
    # Not at module level: optimize imports the passes, and the partition pass this package.
    from distopt.optimize import optimize

    if latency_s is not None and not latency_s >= 0:
        raise ConfigError(f"latency_s: expected seconds >= 0, got {latency_s!r}")
    if not (
        pipeline_staleness in (None, "auto")
        or (isinstance(pipeline_staleness, int) and pipeline_staleness >= 0)
    ):
        raise ConfigError(
            f"pipeline_staleness: expected an integer >= 0 or 'auto', got {pipeline_staleness!r}"
        )
    _graphs(optimized=optimized)
    example_inputs = _as_tuple(example_inputs)
    with torch.no_grad():
        captured = optimize(model, passes=[], verify=False)
    _graphs(captured=captured, optimized=optimized)
    forward = predict(captured, optimized, example_inputs, latency_s, repeats=repeats)
    step = unmeasured = None
    if measure_step:
        try:
            step = _measure_step(model, example_inputs)
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
        unmeasured_step=unmeasured,
        pipelined=pipelined,
        pipeline_staleness=pipeline_staleness,
    )
