"""When an interleaved benchmark's target is decided: the paired bootstrap over rounds."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from distopt.estimate.rounds import Target, round_interval, undecided


def _rounds(ratio: float, rounds: int, *, drift: float, noise: float, seed: int = 0):
    """Two variants measured in the same rounds: the host's speed drifts from round to round
    (both variants alike), each step has its own noise, and ``fast`` takes ``ratio`` × ``slow``."""
    rng = np.random.default_rng(seed)
    speed = 1 + drift * rng.standard_normal(rounds)
    return {
        "slow": [list(s * (1 + noise * rng.standard_normal(27))) for s in speed],
        "fast": [list(ratio * s * (1 + noise * rng.standard_normal(27))) for s in speed],
    }


def _gain(medians):
    return medians["slow"] / medians["fast"]


def test_the_interval_pairs_the_rounds_so_host_drift_cancels() -> None:
    """A drift of ±20% between rounds, shared by both variants, leaves the ratio's interval
    narrow; drawn apart (the variants from different rounds) it would span the drift."""
    rounds = _rounds(0.8, 16, drift=0.2, noise=0.01)
    low, high = round_interval(rounds, _gain)
    assert low <= 1.25 <= high
    assert high - low < 0.03
    shuffled = dict(rounds, fast=rounds["fast"][1:] + rounds["fast"][:1])
    low_apart, high_apart = round_interval(shuffled, _gain)
    assert high_apart - low_apart > 5 * (high - low)


def test_a_target_at_the_ratio_is_undecided_and_one_far_from_it_is_not() -> None:
    rounds = _rounds(1 / 1.02, 8, drift=0.05, noise=0.05)
    found = undecided(
        rounds,
        [
            Target("at", _gain, 1.02),
            Target("below", _gain, 0.9),
            Target("above", _gain, 1.2),
        ],
    )
    assert list(found) == ["at"]
    low, high = found["at"]
    assert low < 1.02 <= high


# Derandomized: the width of one sample's interval is itself random, and with 8 rounds a narrow
# draw failed the 0.9 bound once in a suite run (seed 460: 0.0296 against 0.9 x 0.0310); the
# same examples every run keep CI a check of the code, not of luck.
@settings(max_examples=25, deadline=None, derandomize=True)
@given(
    ratio=st.floats(0.5, 2.0),
    rounds=st.integers(6, 30),
    seed=st.integers(0, 2**16),
)
def test_more_rounds_narrow_the_interval_and_it_holds_the_point_ratio(
    ratio: float, rounds: int, seed: int
) -> None:
    data = _rounds(1 / ratio, 4 * rounds, drift=0.1, noise=0.05, seed=seed)
    quarter = {name: per_round[:rounds] for name, per_round in data.items()}
    pooled = float(
        np.median(np.concatenate(data["slow"])) / np.median(np.concatenate(data["fast"]))
    )
    low, high = round_interval(data, _gain, level=0.99)
    assert low <= pooled <= high
    low_quarter, high_quarter = round_interval(quarter, _gain, level=0.99)
    # Four times the rounds: about half the width, allowing for the bootstrap's own noise.
    assert high - low < 0.9 * (high_quarter - low_quarter)


def test_variants_with_different_numbers_of_rounds_are_refused() -> None:
    with pytest.raises(ValueError, match="same number"):
        round_interval({"slow": [[1.0]], "fast": [[1.0], [1.0]]}, _gain)
