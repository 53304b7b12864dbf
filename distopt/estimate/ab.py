"""Interleaved A/B timing: is a candidate faster than its baseline, on this machine, right now?

Used where a rewrite's gain depends on the machine (a memory layout, a fused kernel) and by
:func:`distopt.optimize`'s final check that an eval model got no slower. Timing costs optimize
time, so a comparison spends as little as the evidence allows:

* rounds are interleaved (one call of each, the order alternating), so drift in the host's load
  hits both variants alike; the verdict compares medians;
* one call of each warms it up (allocator, oneDNN primitives, weights derived or packed on first
  use) and is not counted — except calls longer than :data:`LONG_CALL_S` whose times differ by
  more than the one-round band: one-time costs are a few percent of such a call, so that first
  round decides alone and two long calls are saved;
* it stops as soon as the medians differ by more than the noise allows (a wide band after one
  round, narrowing with more), or when ``budget_s`` is spent, or after ``max_rounds``; calls
  longer than :data:`LONG_CALL_S` may stop after one counted round, shorter ones only after
  ``min_rounds`` and ``min_time_s`` of timing (short calls are cheap to repeat and noisy).

The clock is injectable (``Measurer(clock=...)``), so the decision logic is tested without timing.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from collections.abc import Callable

import torch

Clock = Callable[[str, Callable[[], object]], float]
"""Seconds one call of the function takes; the label is ``"baseline"`` or ``"candidate"``."""

LONG_CALL_S = 0.2
"""Calls at least this long may be decided on one counted round."""

CLEAR_ONE_ROUND = 0.15
"""After one round, medians that differ by more than this fraction decide; the band narrows as
1/√rounds down to twice the margin."""


def wall_clock(label: str, fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def default_clock(label: str, fn: Callable[[], object]) -> float:
    """Wall time; with one intra-op thread, the calling thread's CPU time.

    A single-threaded call runs on the calling thread, so its CPU time is its cost without the
    time the OS gave the core to other processes: on a shared host that noise dwarfs the
    differences being measured. With more threads only wall time sees parallel efficiency.
    """
    if torch.get_num_threads() != 1:
        return wall_clock(label, fn)
    start = time.thread_time()
    fn()
    return time.thread_time() - start


@dataclasses.dataclass(frozen=True)
class ABResult:
    baseline_s: float
    """Median seconds of the baseline's counted calls."""
    candidate_s: float
    rounds: int
    """Counted rounds (each one call of both)."""

    @property
    def speedup(self) -> float:
        return self.baseline_s / self.candidate_s if self.candidate_s > 0 else math.inf

    def describe(self, candidate: str = "with", baseline: str = "without") -> str:
        return (
            f"{candidate} {_ms(self.candidate_s)} vs {baseline} {_ms(self.baseline_s)} "
            f"(median of {self.rounds} interleaved round{'s' * (self.rounds != 1)})"
        )


def _ms(seconds: float) -> str:
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

    def compare(
        self,
        baseline: Callable[[], object],
        candidate: Callable[[], object],
        *,
        warm: bool = False,
        baseline_s: float | None = None,
    ) -> ABResult:
        """Median seconds of ``baseline`` and ``candidate`` over interleaved rounds.

        ``warm``: both have just run on these inputs (no warm-up call; the first round counts).
        ``baseline_s``: the baseline's time in that first round, already measured (it is not
        called then).
        """
        samples: dict[str, list[float]] = {"baseline": [], "candidate": []}
        variants = {"baseline": baseline, "candidate": candidate}
        first = [
            baseline_s if label == "baseline" and baseline_s is not None else self.clock(label, fn)
            for label, fn in variants.items()
        ]
        long_calls = max(first) >= LONG_CALL_S
        if warm or long_calls:
            for label, seconds in zip(variants, first, strict=True):
                samples[label].append(seconds)
        if long_calls and not warm and not self._clear(samples, 1):
            # A long first call's one-time costs are a few percent of it: it decides alone only
            # when the gap is wide; otherwise it is a warm-up and the rounds below decide.
            samples = {"baseline": [], "candidate": []}
        min_rounds = 1 if long_calls else self.min_rounds
        min_time = 0.0 if long_calls else self.min_time_s
        spent = sum(first) if samples["baseline"] else 0.0
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
        return ABResult(
            statistics.median(samples["baseline"]),
            statistics.median(samples["candidate"]),
            len(samples["baseline"]),
        )

    def _clear(self, samples: dict[str, list[float]], rounds: int) -> bool:
        base, cand = statistics.median(samples["baseline"]), statistics.median(samples["candidate"])
        if base <= 0 or cand <= 0:
            return False
        band = max(CLEAR_ONE_ROUND / math.sqrt(rounds), 2 * self.margin)
        return abs(math.log(base / cand)) >= math.log1p(band)

    def keeps(self, result: ABResult) -> bool:
        """The candidate is faster than the baseline by at least the margin."""
        return result.candidate_s <= result.baseline_s * (1 - self.margin)

    def not_slower(self, result: ABResult) -> bool:
        """The candidate is no slower than the baseline, within the margin."""
        return result.candidate_s <= result.baseline_s * (1 + self.margin)
