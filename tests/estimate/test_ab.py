"""Interleaved A/B timing: the verdict and when it stops, with an injected clock (no timing)."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest

from distopt.estimate import ab
from distopt.estimate.ab import Measurer, entered_untimed, one_time_work, untimed, wall_clock


def clock_of(
    seconds: dict[str, float], calls: list[str]
) -> Callable[[str, Callable[[], object]], float]:
    def clock(label: str, fn: Callable[[], object]) -> float:
        calls.append(label)
        return seconds[label]

    return clock


def test_slower_candidate_is_not_kept() -> None:
    m = Measurer(clock=clock_of({"baseline": 0.01, "candidate": 0.02}, []))
    result = m.compare(lambda: None, lambda: None)
    assert (result.baseline_s, result.candidate_s) == (0.01, 0.02)
    assert not m.keeps(result) and not m.not_slower(result)


def test_faster_candidate_is_kept_only_beyond_the_margin() -> None:
    m = Measurer(margin=0.05, clock=clock_of({"baseline": 0.0100, "candidate": 0.0097}, []))
    result = m.compare(lambda: None, lambda: None)
    assert not m.keeps(result) and m.not_slower(result)


def test_a_candidate_slower_within_the_margin_is_slower() -> None:
    # The final check returns the original for it: "never slower than eager" has no allowance.
    m = Measurer(margin=0.05, clock=clock_of({"baseline": 0.0100, "candidate": 0.0102}, []))
    result = m.compare(lambda: None, lambda: None)
    assert not m.keeps(result) and not m.not_slower(result)


def test_rounds_are_interleaved_in_alternating_order_after_one_warm_up_each() -> None:
    calls: list[str] = []
    m = Measurer(
        min_rounds=2, min_time_s=0.0, clock=clock_of({"baseline": 0.01, "candidate": 0.001}, calls)
    )
    m.compare(lambda: None, lambda: None)
    assert calls == ["baseline", "candidate", "baseline", "candidate", "candidate", "baseline"]


def test_long_calls_far_apart_are_decided_by_their_first_calls() -> None:
    calls: list[str] = []
    m = Measurer(clock=clock_of({"baseline": 1.0, "candidate": 0.7}, calls))
    result = m.compare(lambda: None, lambda: None)
    assert result.rounds == 1 and len(calls) == 2


def test_long_calls_close_together_warm_up_then_decide_on_counted_rounds() -> None:
    calls: list[str] = []
    m = Measurer(budget_s=1.0, clock=clock_of({"baseline": 1.0, "candidate": 0.95}, calls))
    result = m.compare(lambda: None, lambda: None)
    assert result.rounds == 1 and len(calls) == 4  # the first calls were only a warm-up


def test_close_calls_stop_at_the_budget() -> None:
    m = Measurer(budget_s=3.0, clock=clock_of({"baseline": 1.0, "candidate": 0.99}, []))
    result = m.compare(lambda: None, lambda: None)
    assert result.rounds == 2  # after the warm-up: 2 s after one round, 4 s after two


def test_short_calls_run_at_least_min_rounds_and_min_time() -> None:
    m = Measurer(
        min_rounds=5,
        min_time_s=0.1,
        max_rounds=100,
        clock=clock_of({"baseline": 0.001, "candidate": 0.0005}, []),
    )
    result = m.compare(lambda: None, lambda: None)
    assert result.rounds == 67  # 1.5 ms a round until 0.1 s spent (clear from the start)


def test_warm_variants_count_their_first_round() -> None:
    calls: list[str] = []
    m = Measurer(clock=clock_of({"baseline": 1.0, "candidate": 0.5}, calls))
    result = m.compare(lambda: None, lambda: None, warm=True)
    assert result.rounds == 1 and len(calls) == 2


def test_a_variant_timed_already_is_not_called_again() -> None:
    calls: list[str] = []
    m = Measurer(clock=clock_of({"baseline": 1.0, "candidate": 0.5}, calls))
    result = m.compare(lambda: None, lambda: None, warm=True, baseline_s=1.0, candidate_s=0.5)
    assert result.rounds == 1 and calls == []  # the known times decide alone
    result = m.compare(lambda: None, lambda: None, baseline_s=1.0)
    assert result.rounds == 1 and calls == ["candidate"]


def test_times_given_do_not_spend_the_budget() -> None:
    """Close 1.2 s calls, both timed before: that first round cost this comparison nothing, so
    the budget buys a round of its own before the verdict (not one unclear round alone)."""
    calls: list[str] = []
    m = Measurer(budget_s=2.0, clock=clock_of({"baseline": 1.2, "candidate": 1.19}, calls))
    result = m.compare(lambda: None, lambda: None, warm=True, baseline_s=1.2, candidate_s=1.19)
    assert result.rounds == 2 and calls == ["candidate", "baseline"]


def test_the_clock_leaves_out_one_time_work() -> None:
    def call() -> None:
        with one_time_work():
            time.sleep(0.05)

    assert wall_clock("candidate", call) < 0.01
    with one_time_work():  # outside a timed call it is just work
        pass


class _Clock:
    """A clock that moves only when told to."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class _Entered:
    """A context whose entering and leaving each move ``clock`` by ``seconds``; recorded in
    ``log`` (with the error it left with, if any)."""

    def __init__(
        self, name: str, log: list[str], clock: _Clock | None = None, seconds: float = 0.0,
        fail: bool = False,
    ) -> None:  # fmt: skip
        self.name, self.log, self.clock, self.seconds, self.fail = name, log, clock, seconds, fail

    def __enter__(self) -> str:
        if self.clock is not None:
            self.clock.now += self.seconds
        if self.fail:
            raise RuntimeError(f"{self.name} cannot be entered")
        self.log.append(f"enter {self.name}")
        return self.name

    def __exit__(self, kind: type[BaseException] | None, *rest: object) -> None:
        if self.clock is not None:
            self.clock.now += self.seconds
        self.log.append(f"exit {self.name}" + (f" on {kind.__name__}" if kind else ""))


def test_the_clock_leaves_out_the_measurements_own_work_around_a_call() -> None:
    """Putting a model's state aside and back grows with its buffers, not its compute (on an H200
    it made ResNet-50's timed calls 4–6× the model's): the clock counts only the call."""
    clock, log = _Clock(), []

    def call() -> None:
        with entered_untimed(_Entered("a", log, clock, 1.0), _Entered("b", log, clock, 1.0)) as got:
            assert got == ["a", "b"]
            clock.now += 0.25
        with untimed():
            clock.now += 1.0

    assert ab._timed(call, clock) == 0.25
    assert log == ["enter a", "enter b", "exit b", "exit a"]


def test_contexts_entered_untimed_are_left_when_the_call_or_an_entry_fails() -> None:
    log: list[str] = []
    with pytest.raises(ValueError, match="the call failed"):
        with entered_untimed(_Entered("a", log), _Entered("b", log)):
            raise ValueError("the call failed")
    assert log == ["enter a", "enter b", "exit b on ValueError", "exit a on ValueError"]
    log.clear()
    with pytest.raises(RuntimeError, match="b cannot be entered"):
        with entered_untimed(_Entered("a", log), _Entered("b", log, fail=True)):
            raise AssertionError("not reached")
    assert log == ["enter a", "exit a"]
