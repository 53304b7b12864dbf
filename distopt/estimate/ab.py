"""Interleaved A/B timing: is a candidate faster than its baseline, on this machine, right now?

Used where a rewrite's gain depends on the machine (a memory layout, a fused kernel) and by
:func:`distopt.optimize`'s final check that an eval model got no slower. Timing costs optimize
time, so a comparison spends as little as the evidence allows:

* rounds are interleaved (one call of each, the order alternating), so drift in the host's load
  hits both variants alike; the verdict compares medians;
* one call of each warms it up (allocator, oneDNN primitives) and is not counted — except calls
  longer than :data:`LONG_CALL_S` on the CPU whose times differ by more than the one-round band:
  one-time costs are a few percent of such a call, so that first round decides alone and two long
  calls are saved (not on a GPU, whose first calls load kernels). Work a call does once and
  caches — weights derived and packed on first use, an eighth of ResNet-50's first fused call at
  one thread — is timed where it happens (:func:`one_time_work`) and left out of the call's time,
  so it does not blur that first round; so is the measurement's own work around a call, putting
  aside and back the state it may write (:func:`untimed`);
* it stops as soon as the medians differ by more than the noise allows (a wide band after one
  round, narrowing with more), or when ``budget_s`` is spent, or after ``max_rounds``; calls
  longer than :data:`LONG_CALL_S` may stop after one counted round, shorter ones only after
  ``min_rounds`` and ``min_time_s`` of timing (short calls are cheap to repeat and noisy).

The clock is injectable (``Measurer(clock=...)``), so the decision logic is tested without timing.
Once this process has used CUDA, every clock here waits for the GPU before it starts and stops
(kernels run asynchronously: without it a call's time is its launch time).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

Clock = Callable[[str, Callable[[], object]], float]
"""Seconds one call of the function takes; the label is ``"baseline"`` or ``"candidate"``."""

LONG_CALL_S = 0.2
"""Calls at least this long may be decided on one counted round."""

CLEAR_ONE_ROUND = 0.15
"""After one round, medians that differ by more than this fraction decide; the band narrows as
1/√rounds down to twice the margin."""


@dataclasses.dataclass
class _Timing:
    """A call being timed: the clock it is read with and the seconds left out of it so far (its
    :func:`one_time_work` and the measurement's own :func:`untimed` work)."""

    now: Callable[[], float]
    left_out_s: float = 0.0


_TIMING: contextvars.ContextVar[_Timing | None] = contextvars.ContextVar(
    "distopt_timing", default=None
)


@contextlib.contextmanager
def one_time_work() -> Iterator[None]:
    """Work a call does once and caches (weights derived and packed on first use).

    A clock timing the call leaves this work's seconds out: the comparison is about the calls that
    follow, which do not repeat it. Only a first computation may be marked so: a value recomputed
    on every call is part of every call's cost.
    """
    timing = _TIMING.get()
    if timing is None:
        yield
        return
    start = timing.now()
    try:
        yield
    finally:
        timing.left_out_s += timing.now() - start


@contextlib.contextmanager
def untimed() -> Iterator[None]:
    """The measurement's own work around a timed call: putting aside and back the state the call
    may write (:func:`distopt.remote.isolation.preserved_state`), left out of the call's time.

    That work grows with the model's buffers, not its compute, and on a GPU each buffer's
    comparison waits for the device: on an H200, ResNet-50 (159 BatchNorm buffers) timed 20 and
    27 ms a call inside ``distopt.optimize``'s speed check, where the model alone ran in 4.7
    (docs/benchmarks.md, 2026-11-30). The GPUs are waited for at both ends, so that the call's
    queued kernels count as the call's and this work's as this work's."""
    timing = _TIMING.get()
    if timing is None:
        yield
        return
    sync_gpus()
    start = timing.now()
    try:
        yield
    finally:
        sync_gpus()
        timing.left_out_s += timing.now() - start


@contextlib.contextmanager
def entered_untimed(*contexts: contextlib.AbstractContextManager[Any]) -> Iterator[list[Any]]:
    """Enter ``contexts`` before the block and leave them after it, both :func:`untimed`: the block
    is the timed call. Yields what each context gave, in order."""
    with untimed():
        stack = contextlib.ExitStack()
        with contextlib.ExitStack() as on_error:  # a context that fails to enter: leave the rest
            on_error.callback(stack.close)
            entered = [stack.enter_context(context) for context in contexts]
            on_error.pop_all()
    try:
        yield entered
    except BaseException:
        with untimed():  # the contexts see the call's error, as in a plain ``with``
            if not stack.__exit__(*sys.exc_info()):
                raise
    else:
        with untimed():
            stack.close()


def using_gpus() -> bool:
    """Whether this process has started CUDA (then every clock here waits for the GPUs)."""
    # is_initialized: a process that never touched the GPU pays nothing and starts no context.
    return torch.cuda.is_available() and torch.cuda.is_initialized()


def sync_gpus() -> None:
    """Wait until every GPU this process uses has done the work queued on it."""
    if using_gpus():
        for index in range(torch.cuda.device_count()):
            torch.cuda.synchronize(index)


def now() -> float:
    """``time.perf_counter()`` once the GPUs are idle: time read around GPU work counts the work."""
    sync_gpus()
    return time.perf_counter()


def _timed(fn: Callable[[], object], clock: Callable[[], float]) -> float:
    timing = _Timing(clock)
    token = _TIMING.set(timing)
    try:
        sync_gpus()
        start = clock()
        fn()
        sync_gpus()  # fn may have been the first to use a GPU
        return clock() - start - timing.left_out_s
    finally:
        _TIMING.reset(token)


def wall_clock(label: str, fn: Callable[[], object]) -> float:
    """Wall seconds of one call, less its :func:`one_time_work`."""
    return _timed(fn, time.perf_counter)


def default_clock(label: str, fn: Callable[[], object]) -> float:
    """Wall time; with one intra-op thread and no GPU in use, the calling thread's CPU time (less
    the call's :func:`one_time_work` either way).

    A single-threaded call runs on the calling thread, so its CPU time is its cost without the
    time the OS gave the core to other processes: on a shared host that noise dwarfs the
    differences being measured. With more threads only wall time sees parallel efficiency, and
    the CPU time of a thread waiting for the GPU is not the call's cost.
    """
    cpu_time = torch.get_num_threads() == 1 and not using_gpus()
    return _timed(fn, time.thread_time if cpu_time else time.perf_counter)


@dataclasses.dataclass(frozen=True)
class ABResult:
    baseline_s: float
    """Median seconds of the baseline's counted calls."""
    candidate_s: float
    rounds: int
    """Counted rounds (each one call of both)."""
    baseline_timed: bool = True
    """The baseline's median is of calls timed here (not only the first sample it was given)."""

    @property
    def speedup(self) -> float:
        return self.baseline_s / self.candidate_s if self.candidate_s > 0 else math.inf

    def describe(self, candidate: str = "with", baseline: str = "without") -> str:
        return (
            f"{candidate} {format_seconds(self.candidate_s)} vs {baseline} "
            f"{format_seconds(self.baseline_s)} "
            f"(median of {self.rounds} interleaved round{'s' * (self.rounds != 1)})"
        )


def format_seconds(seconds: float) -> str:
    """``1.52 s`` or ``855 ms``: how a report gives a call's time."""
    return f"{seconds:.2f} s" if seconds >= 1 else f"{seconds * 1e3:.3g} ms"


@dataclasses.dataclass(kw_only=True)
class Measurer:
    """Settings of one optimize run's comparisons (from :class:`distopt.config.MeasureConfig`)."""

    margin: float = 0.02
    """A candidate wins when its median is at least this fraction below the baseline's."""
    budget_s: float = 2.0
    max_rounds: int = 30
    min_rounds: int = 5
    """Counted rounds at least when calls are short (long calls: one)."""
    min_time_s: float = 0.25
    """Seconds of timing at least when calls are short."""
    clock: Clock = default_clock
    first_call_decides: bool = True
    """Whether a long first call may decide alone (module docstring). Not on a GPU, whose first
    calls load kernels: :func:`measurer_for_this_process` sets it."""

    def compare(
        self,
        baseline: Callable[[], object],
        candidate: Callable[[], object],
        *,
        warm: bool = False,
        baseline_s: float | None = None,
        candidate_s: float | None = None,
    ) -> ABResult:
        """Median seconds of ``baseline`` and ``candidate`` over interleaved rounds.

        ``warm``: both have just run on these inputs (no warm-up call; the first round counts).
        ``baseline_s``, ``candidate_s``: a variant's time in that first round, already measured
        (it is not called then).
        """
        samples: dict[str, list[float]] = {"baseline": [], "candidate": []}
        variants = {"baseline": baseline, "candidate": candidate}
        known = {"baseline": baseline_s, "candidate": candidate_s}
        first = [
            seconds if (seconds := known[label]) is not None else self.clock(label, fn)
            for label, fn in variants.items()
        ]
        # On a GPU a first call also loads kernels and plans cuDNN convolutions (lazily, ~1 s
        # for a conv net): far more than a few percent of it, so it never decides alone there.
        long_calls = max(first) >= LONG_CALL_S and self.first_call_decides
        if warm or long_calls:
            for label, seconds in zip(variants, first, strict=True):
                samples[label].append(seconds)
        if long_calls and not warm and not self._clear(samples, 1):
            # A long first call's one-time costs are a few percent of it: it decides alone only
            # when the gap is wide; otherwise it is a warm-up and the rounds below decide.
            samples = {"baseline": [], "candidate": []}
        min_rounds = 1 if long_calls else self.min_rounds
        min_time = 0.0 if long_calls else self.min_time_s
        # The budget is for calls made here: a time measured before (given) cost this nothing,
        # and counting it stopped 1 s calls after one unclear round (ConvNeXt-T at one thread).
        spent = (
            sum(s for label, s in zip(variants, first, strict=True) if known[label] is None)
            if samples["baseline"]
            else 0.0
        )
        round_index = 1 if samples["baseline"] else 0
        while True:
            rounds = len(samples["baseline"])
            if rounds >= self.max_rounds:
                break
            if (
                rounds >= min_rounds
                and spent >= min_time
                and (spent >= self.budget_s or self._clear(samples, rounds))
            ):
                break
            order = ("baseline", "candidate") if round_index % 2 == 0 else ("candidate", "baseline")
            for label in order:
                seconds = self.clock(label, variants[label])
                samples[label].append(seconds)
                spent += seconds
            round_index += 1
        given_only = baseline_s is not None and samples["baseline"] == [baseline_s]
        return ABResult(
            statistics.median(samples["baseline"]),
            statistics.median(samples["candidate"]),
            len(samples["baseline"]),
            baseline_timed=not given_only,
        )

    def _clear(self, samples: dict[str, list[float]], rounds: int) -> bool:
        base, cand = statistics.median(samples["baseline"]), statistics.median(samples["candidate"])
        if base <= 0 or cand <= 0:
            return False
        return abs(math.log(base / cand)) >= math.log1p(self._band(rounds))

    def _band(self, rounds: int) -> float:
        """How far apart medians of ``rounds`` rounds must be to tell them apart."""
        return max(CLEAR_ONE_ROUND / math.sqrt(rounds), 2 * self.margin)

    def clearly_slower(self, result: ABResult) -> bool:
        """The candidate measured slower than the baseline by more than the noise of its rounds
        allows (the band :meth:`compare` stops at)."""
        return result.candidate_s > result.baseline_s * (1 + self._band(result.rounds))

    def keeps(self, result: ABResult) -> bool:
        """The candidate is faster than the baseline by at least the margin."""
        return result.candidate_s <= result.baseline_s * (1 - self.margin)

    def not_slower(self, result: ABResult) -> bool:
        """The candidate's median is no slower than the baseline's (no margin: a model that
        measured slower, however little, is not returned; with a 2% margin the final check kept
        xdeepfm at 2.11 ms against 2.07, and coverage_speed then measured it at 0.94× eager)."""
        return result.candidate_s <= result.baseline_s


def measurer_for_this_process(**settings: Any) -> Measurer:
    """A :class:`Measurer` with ``settings``, whose long first calls decide only off the GPU."""
    return Measurer(first_call_decides=not using_gpus(), **settings)
