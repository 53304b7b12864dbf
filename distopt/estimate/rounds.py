"""Whether an interleaved benchmark's target is decided yet, from the spread between its rounds
(and, through :func:`round_interval`, whether the cost model's rehearsal knows its gains yet:
:func:`distopt.optimize.gain.rehearse`).

A target such as "optimized ≥ 0.98× hand" compares two medians measured in the same rounds. Where
the true ratio sits within a few percent of the target, a fixed number of rounds decides it by
the host's noise: issue 23's RPC sweeps missed two or three such points per run, a different
two or three each time, and each missed point met its target in the next run.

:func:`round_interval` gives the interval of a statistic of the variants' pooled medians by a
bootstrap over whole rounds. A round is the unit that is independent: its variants ran back to
back on the same host state, so every resample draws the same rounds for every variant (a
paired bootstrap). :func:`undecided` names the targets whose interval still holds their
threshold; a benchmark runs more rounds while any is undecided, up to a cap, and scores the
pooled median of all its rounds as before. The rule stops on either side of the target, so it
decides a miss as readily as a pass.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

Statistic = Callable[[Mapping[str, Any]], Any]
"""Maps each variant's median to the statistic's value, element-wise: given arrays (one median
per resample) it returns an array, given floats (a run's medians) a float."""

LEVEL = 0.9
RESAMPLES = 1000
SEED = 0


@dataclasses.dataclass(frozen=True, slots=True)
class Target:
    """A statistic of the variants' median step times that a benchmark scores against ``at_least``."""

    name: str
    statistic: Statistic
    at_least: float


def round_interval(
    rounds: Mapping[str, Sequence[Sequence[float]]],
    statistic: Statistic,
    *,
    level: float = LEVEL,
    resamples: int = RESAMPLES,
    seed: int = SEED,
) -> tuple[float, float]:
    """Percentile-bootstrap interval of ``statistic`` over the medians of the pooled samples,
    drawing whole rounds with replacement, the same rounds for every variant. ``rounds[name][r]``
    is variant ``name``'s samples in round ``r``; every variant has the same number of rounds."""
    return _interval(statistic(resampled_medians(rounds, resamples, seed)), level)


def undecided(
    rounds: Mapping[str, Sequence[Sequence[float]]],
    targets: Sequence[Target],
    *,
    level: float = LEVEL,
    resamples: int = RESAMPLES,
    seed: int = SEED,
) -> dict[str, tuple[float, float]]:
    """The targets whose ``level`` interval still holds their threshold, with their intervals."""
    medians = resampled_medians(rounds, resamples, seed)
    found = {}
    for target in targets:
        low, high = _interval(target.statistic(medians), level)
        if low < target.at_least <= high:
            found[target.name] = (low, high)
    return found


def resampled_medians(
    rounds: Mapping[str, Sequence[Sequence[float]]], resamples: int, seed: int
) -> dict[str, np.ndarray]:
    """Each variant's pooled median in each of ``resamples`` draws of whole rounds (with
    replacement, the same rounds for every variant)."""
    counts = {len(per_round) for per_round in rounds.values()}
    if len(counts) != 1 or 0 in counts:
        raise ValueError(f"every variant needs the same number (>= 1) of rounds, got {counts}")
    (n,) = counts
    drawn = np.random.default_rng(seed).integers(0, n, size=(resamples, n))
    return {name: _resampled_medians(per_round, drawn) for name, per_round in rounds.items()}


def _interval(values: np.ndarray, level: float) -> tuple[float, float]:
    tail = (1 - level) / 2
    low, high = np.quantile(values, [tail, 1 - tail])
    return float(low), float(high)


def _resampled_medians(per_round: Sequence[Sequence[float]], drawn: np.ndarray) -> np.ndarray:
    """The median of the samples of the rounds in each row of ``drawn``."""
    lengths = {len(samples) for samples in per_round}
    if len(lengths) == 1:  # one array op: rows of drawn rounds, flattened per resample
        table = np.asarray(per_round, dtype=float)
        return np.median(table[drawn].reshape(len(drawn), -1), axis=1)
    arrays = [np.asarray(samples, dtype=float) for samples in per_round]
    return np.array([np.median(np.concatenate([arrays[r] for r in row])) for row in drawn])
