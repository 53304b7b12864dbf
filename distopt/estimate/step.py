"""The whole training step, phase by phase: what the trainer measures and what the cost model
predicts, with the same names, so that a wrong term shows as one wrong row (docs/cost_model.md).

A step of the QPS log (its ``step_time_s``) is the sum of these disjoint phases, plus a
remainder (bookkeeping between them):

* ``data`` — taking the next batch (from the loader or the pipeline) and moving it to the device;
* ``forward`` — the model and its loss; ``waits`` is the part of it spent blocked on remote
  requests (:func:`distopt.ps.take_wait_time`);
* ``backward`` — autograd, the DDP gradient all-reduce included; ``all_reduce`` is the part of it
  after the local gradients were done (the all-reduce that backward did not hide);
* ``pushes`` — the trainer's gradient pushes to the parameter servers (in deterministic jobs one
  trainer at a time, each waiting for its push);
* ``optimizer`` — clipping, the optimizer and scheduler step.

Over many steps, the median step is not the sum of the phases' medians: a step's phases vary
together (a late read makes its forward long and its push wait), and the remainder adds to each.
``other`` is that difference, median step less the sum of the phases' medians, reported on both
sides (:data:`OTHER`), so that the rows of a report add up to its step.

:class:`StepPhases` measures them in the training loop. :func:`predict_step` predicts each for
the model as written and as optimized, from start-up measurements of that phase (steps rehearsed
by the job's trainers together — forward, backward with the gradient all-reduce, pushes in
turn; the job's optimizer stepping copies of the parameters) or from a model of it (data as a
loader that keeps up).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import statistics
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Literal

import torch
from torch import nn

from distopt.estimate.ab import now

PHASES: tuple[str, ...] = ("data", "forward", "backward", "pushes", "optimizer")
"""The disjoint phases of a step, in order."""
PARTS: dict[str, str] = {"waits": "forward", "all_reduce": "backward"}
"""Measured parts of a phase: part → the phase that contains it."""
OTHER = "other"
"""The median step less the sum of its phases' medians (see the module): not a phase of one step,
a property of many, so the training loop does not log it; the rehearsal and ``distopt compare``
derive it from the steps."""


def other_s(median_step_s: float, phase_medians: Mapping[str, float]) -> float:
    """:data:`OTHER`: the median step less the sum of the phases' medians."""
    return median_step_s - sum(phase_medians.get(name, 0.0) for name in PHASES)


def phase_medians(steps: Sequence[Mapping[str, float]], median_step_s: float) -> dict[str, float]:
    """The measured side of a per-phase report: each phase's (and part's) median over ``steps``
    (the phases of each step, as :meth:`StepPhases.take` returns them; one missing counts 0),
    and :data:`OTHER`, what those medians leave of the median step ``median_step_s``."""
    medians = {
        name: float(statistics.median(step.get(name, 0.0) for step in steps)) for name in steps[0]
    }
    return {**medians, OTHER: other_s(median_step_s, medians)}


LOGGED: tuple[str, ...] = (
    "data",
    "forward",
    "waits",
    "backward",
    "all_reduce",
    "pushes",
    "optimizer",
)
"""What the training loop logs per step: the phases and their parts, in step order."""
REPORTED: tuple[str, ...] = (*LOGGED, OTHER)
"""The rows of a per-phase report, in step order."""


class StepPhases:
    """Seconds of each phase of the trainer's current step (see the module docstring).

    ``wait_time``: reads and resets the seconds this process spent blocked on remote requests
    (:func:`distopt.ps.take_wait_time`), ``None`` without parameter servers. The part of it inside
    ``forward`` is the step's ``waits``; all of it is :attr:`waited_s`.
    """

    def __init__(self, wait_time: Callable[[], float] | None = None) -> None:
        self._wait_time = wait_time
        self._seconds = dict.fromkeys(PHASES, 0.0)
        self._parts = dict.fromkeys(PARTS, 0.0)
        self.waited_s = 0.0
        """Seconds blocked on remote requests in the step so far, in any phase."""

    def _waited(self) -> float:
        if self._wait_time is None:
            return 0.0
        seconds = self._wait_time()
        self.waited_s += seconds
        return seconds

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Time the block as (part of) phase ``name``."""
        if name not in self._seconds:
            raise ValueError(f"phase: expected one of {', '.join(PHASES)}, got {name!r}")
        self._waited()  # waits before the block belong to no part
        start = time.perf_counter()
        try:
            yield
        finally:
            self._seconds[name] += time.perf_counter() - start
            waited = self._waited()
            if name == "forward":
                self._parts["waits"] += waited

    @contextlib.contextmanager
    def backward(self, loss: torch.Tensor) -> Iterator[None]:
        """Time the block (``loss.backward()``) as ``backward``, and its ``all_reduce`` part: the
        time after autograd's local work ended (the first callback queued at backward's start
        runs then, before DDP's, which waits for the gradient all-reduce)."""
        local_end: list[float] = []
        grad_fn = loss.grad_fn
        handle = None
        if grad_fn is not None:
            queue = torch.autograd.Variable._execution_engine.queue_callback  # type: ignore[attr-defined]

            def at_start(_grads: Any) -> None:
                queue(lambda: local_end.append(time.perf_counter()))

            handle = grad_fn.register_prehook(at_start)
        try:
            with self.phase("backward"):
                yield
            if local_end:
                end = time.perf_counter()
                self._parts["all_reduce"] += max(0.0, end - local_end[0])
        finally:
            if handle is not None:
                handle.remove()

    def take(self) -> dict[str, float]:
        """This step's phases and parts (seconds, :data:`LOGGED` order); starts the next step."""
        self._waited()
        taken = {**self._seconds, **self._parts}
        self._seconds = dict.fromkeys(PHASES, 0.0)
        self._parts = dict.fromkeys(PARTS, 0.0)
        return {name: taken[name] for name in LOGGED}

    def take_waited(self) -> float:
        """Seconds blocked on remote requests since the last call (the step's ``wait_s``)."""
        self._waited()
        waited, self.waited_s = self.waited_s, 0.0
        return waited


@dataclasses.dataclass(frozen=True, slots=True)
class StepPrediction:
    """Predicted seconds of each reported phase of a step, for the model as written
    (``baseline``) and as optimized, and what each prediction assumed."""

    baseline: Mapping[str, float]
    optimized: Mapping[str, float]
    assumptions: Mapping[str, str]
    """Phase → how it was predicted (a measurement, or the model and its assumption)."""

    @staticmethod
    def total(phases: Mapping[str, float]) -> float:
        """The step: the sum of the disjoint phases and :data:`OTHER` (parts are inside them)."""
        return sum(phases.get(name, 0.0) for name in (*PHASES, OTHER))

    @property
    def baseline_s(self) -> float:
        return self.total(self.baseline)

    @property
    def optimized_s(self) -> float:
        return self.total(self.optimized)

    @property
    def gain(self) -> float:
        return self.baseline_s / self.optimized_s if self.optimized_s > 0 else math.inf

    def to_header(self) -> dict[str, Any]:
        """The QPS-log header keys (docs/qps_log_format.md)."""
        return {
            "predicted_gain": self.gain,
            "predicted_step_time_s": self.optimized_s,
            "predicted_saving_s": self.baseline_s - self.optimized_s,
            "predicted_phases": {
                "baseline": dict(self.baseline),
                "optimized": dict(self.optimized),
                "how": dict(self.assumptions),
            },
        }


def median_time(call: Callable[[], object], *, repeats: int, warmup: int = 1) -> float:
    """Median seconds of ``call()`` over ``repeats`` calls after ``warmup`` untimed ones."""
    for _ in range(warmup):
        call()
    samples = []
    for _ in range(repeats):
        start = now()
        call()
        samples.append(now() - start)
    return statistics.median(samples)


def gradient_bytes(model: nn.Module) -> int:
    """Bytes of the dense gradients DDP all-reduces (trainable parameters of ``model``)."""
    return sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)


PushMode = Literal["none", "async", "blocking", "in_turn"]
"""How a step sends its gradient pushes to distopt's parameter servers: ``none`` (it pushes
nothing through them), ``async`` (issued, then the next step's reads of a table wait for it:
:mod:`distopt.ps.client.ordering`), ``blocking`` (each trainer waits for its own), ``in_turn``
(deterministic jobs: the trainers push one after the other, each waiting for its answer and
then for a barrier)."""

SCHEDULES: tuple[str, ...] = ("baseline", "optimized", "pipelined")
"""What a step prediction covers: the model as written, as optimized, and the optimized model
in a cross-step pipeline."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class StepCosts:
    """What a step prediction is made from (seconds): the phases of rehearsed steps, and the
    parts of a job's step a lone trainer's rehearsal cannot show."""

    rehearsed: Mapping[str, Mapping[str, float]]
    """Per schedule (:data:`SCHEDULES`, those rehearsed): the median ``forward``, ``waits``,
    ``backward`` and ``pushes`` (``data``: taking the batch, a pipeline's prefetched one;
    ``optimizer`` when the rehearsal was given the job's optimizer: its step on copies of the
    parameters), and :data:`OTHER`, of steps run at start-up on the job's first batches in turn —
    remote reads sent for real, distopt pushes as dry runs (the servers run the update's kernels
    on the same rows, writing back what was there), a remote write of the user's own not applied
    but stood in for (its arguments sent to its server, not applied; without a stand-in, waited
    out at :attr:`read_latency_s`) (:func:`distopt.optimize.gain.rehearse`)."""
    pushes: PushMode = "none"
    """How the rehearsal pushed (``in_turn``: each trainer's blocking push in its turn)."""
    trainers: int = 1
    """Trainers that rehearsed together, in step as they train: with more than one, every
    rehearsed step's backward holds the gradient all-reduce (:attr:`all_reduce_bytes`) and its
    pushes every trainer's turn and barrier (``in_turn``)."""
    all_reduce_bytes: int = 0
    """Dense gradient bytes the rehearsal all-reduced after each backward (0: none)."""
    data_s: float = 0.0
    """Seconds the loader adds to taking a batch: a loader without workers reads each batch in
    the trainer's step, timed over the batches the trainer read ahead at start-up (0: its
    workers keep up)."""
    writes_not_applied: int = 0
    """Remote writes per rehearsed step not applied: a stand-in sent in their place, or
    waited out."""
    writes_waited_out: int = 0
    """Those of :attr:`writes_not_applied` with no stand-in to send: waited out at
    :attr:`read_latency_s`."""
    read_latency_s: float = 0.0
    """The model's median remote read (what a write not sent costs)."""
    pipeline_depth: int | None = None
    """The staleness the rehearsed pipeline ended at (it deepens while its reads arrive late)."""
    rounds: int = 0
    """Rounds the rehearsal ran, each a chunk of steps of every schedule in turn (more while a
    gain was not yet known within ±5%: :func:`distopt.optimize.gain.rehearse`)."""


def predict_phases(costs: StepCosts, schedule: str) -> dict[str, float]:
    """The reported phases (:data:`REPORTED`) of a step of ``schedule``: its rehearsed phases
    (the all-reduce and every trainer's turn to push among them when the trainers rehearsed
    together; the optimizer step when the rehearsal took it)."""
    rehearsed = costs.rehearsed[schedule]
    return {
        "data": costs.data_s + rehearsed.get("data", 0.0),
        "forward": rehearsed["forward"],
        "waits": rehearsed["waits"],
        "backward": rehearsed["backward"],
        "all_reduce": rehearsed.get("all_reduce", 0.0),
        "pushes": rehearsed["pushes"],
        "optimizer": rehearsed.get("optimizer", 0.0),
        OTHER: rehearsed.get(OTHER, 0.0),
    }


def assumptions(costs: StepCosts) -> dict[str, str]:
    """How each phase of :func:`predict_phases` was predicted (the QPS-log header's ``how``)."""
    writes = ""
    if costs.writes_not_applied:
        writes = f"; {costs.writes_not_applied} remote write(s) per step not applied"
        sent = costs.writes_not_applied - costs.writes_waited_out
        if sent:
            writes += f", {sent} sent as stand-ins (their arguments to their server, not applied)"
        if costs.writes_waited_out:
            writes += (
                f", {costs.writes_waited_out} waited out at the model's median read "
                f"({costs.read_latency_s * 1e3:.2f} ms)"
            )
    rehearsed = (
        "median of steps rehearsed at start-up on the job's first batches in turn (reads sent)"
    )
    if costs.rounds:
        rehearsed = (
            "median of steps rehearsed at start-up on the job's first batches in turn (reads "
            f"sent), every schedule in each of {costs.rounds} rounds"
        )
    if costs.trainers > 1:
        rehearsed = f"{rehearsed}, the {costs.trainers} trainers in step"
    push_how = {
        "none": "0: the step pushes nothing to distopt's parameter servers",
        "async": f"sending the push, {rehearsed} with dry-run pushes (the servers run the "
        "update's kernels on the rows and write back what was there); the rest of its round "
        "trip is waited for by the next step's reads, in forward and waits",
        "blocking": f"a dry-run push's round trip, {rehearsed}",
        "in_turn": f"the trainers push one after the other, each turn a dry-run push's round trip "
        f"and a barrier, {rehearsed}",
    }
    all_reduce = "0: no gradient all-reduce"
    if costs.all_reduce_bytes:
        all_reduce = (
            f"the trainers all-reduce {costs.all_reduce_bytes:,} dense gradient bytes in one call "
            f"after each rehearsed backward (the wait for the slower trainer in it), {rehearsed}"
        )
    stepped = all("optimizer" in phases for phases in costs.rehearsed.values())
    data = (
        f"taking the batch, rehearsed (a pipeline's prefetched batch), and "
        f"{costs.data_s * 1e3:.2f} ms of reading it: the loader reads in the trainer's process "
        "(no workers), the median over the batches read ahead at start-up"
        if costs.data_s
        else "taking the batch, rehearsed (a pipeline's prefetched batch); the loader keeps up "
        "(batches are ready when asked for)"
    )
    return {
        "data": data,
        "forward": rehearsed,
        "waits": f"the part of the forward blocked on remote reads, {rehearsed}",
        "backward": f"{rehearsed}{writes}, all_reduce in it",
        "all_reduce": all_reduce,
        "pushes": push_how[costs.pushes],
        "optimizer": f"the job's optimizer step on copies of the parameters, with each step's "
        f"gradients, {rehearsed}"
        if stepped
        else "0: not rehearsed (no optimizer given, or copies of the parameters would not fit "
        "in memory)",
        OTHER: f"the rehearsed steps' median less the sum of their phases' medians ({rehearsed})",
    }


def predict_step(costs: StepCosts, *, optimized: str = "optimized") -> StepPrediction:
    """The step of the model as written and of schedule ``optimized`` (``"pipelined"`` for a
    pipeline), phase by phase (:func:`predict_phases`)."""
    return StepPrediction(
        baseline=predict_phases(costs, "baseline"),
        optimized=predict_phases(costs, optimized),
        assumptions=assumptions(costs),
    )
