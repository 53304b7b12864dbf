"""Embedding ids as workloads draw them and as a cache sees them: Zipf(α) sampling, α fitted to
observed counts, and the static-optimal hit rate of a cache of C rows.

Real recommendation ids are skewed (a few rows take most accesses); uniform ids hide what a
row cache can gain. :func:`zipf_ids` draws rank ``r`` (1-based) with probability
``r^-α / H(N, α)`` over a table of ``N`` rows and returns id ``r - 1``: id 0 is the hottest row
(rows are sharded by ``id % servers``, so hot rows spread evenly over the servers). Sampling is
inverse-CDF over a precomputed float64 cumulative (8 bytes a row, made once per ``(N, α)``:
about 50 ms and 8 MB for 1M rows; a draw is one binary search). Any α > 0 works, α ≤ 1 too,
which ``numpy``'s ``Generator.zipf`` (unbounded, α > 1 only) does not offer.

:func:`fit_zipf_alpha` is the maximum-likelihood estimate of α over the ids seen at least
``min_count`` times, ranked by count: the α whose mean log-rank equals the observed one. Not the
least-squares slope of the log-log rank-frequency plot: that fit weights every rank alike, so
the long noisy tail of ids seen once or twice (most of the points, few of the accesses) sets
the slope, and it is biased even on exact Zipf samples (Clauset, Shalizi & Newman 2009, "Power-law
distributions in empirical data"). The tail below ``min_count`` is left out because ranks
estimated from a handful of counts are mostly ties and noise.

:func:`static_optimal_hit_rate` is the share of accesses the ``C`` most frequent ids take: the
best a cache holding a fixed set of ``C`` rows could do over the same accesses.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable

import numpy as np
import torch

from distopt.config import check


@functools.lru_cache(maxsize=4)
def zipf_cdf(num_rows: int, alpha: float) -> torch.Tensor:
    """``[num_rows]`` float64: ``P(rank <= r + 1)`` of Zipf(``alpha``) over ``num_rows`` ranks
    (the last entry exactly 1)."""
    check(num_rows >= 1, "num_rows", "an integer >= 1", num_rows)
    check(math.isfinite(alpha) and alpha > 0, "alpha", "a finite number > 0", alpha)
    weights = torch.arange(1, num_rows + 1, dtype=torch.float64).pow_(-alpha)
    cumulative = torch.cumsum(weights, 0)
    return cumulative.div_(cumulative[-1].clone())


def zipf_ids(
    shape: tuple[int, ...],
    *,
    num_rows: int,
    alpha: float,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """int64 ids in ``0 .. num_rows - 1`` of ``shape``: id ``i`` with probability ∝ ``(i + 1)^-alpha``.

    The same ``generator`` state gives the same ids."""
    cdf = zipf_cdf(num_rows, float(alpha))
    draws = torch.rand(shape, generator=generator, dtype=torch.float64)
    # The first rank whose cumulative exceeds the draw; a draw is < 1 = cdf[-1], so <= num_rows - 1.
    return torch.searchsorted(cdf, draws, right=True)


def id_counts(ids: np.ndarray | torch.Tensor) -> np.ndarray:
    """How often each distinct id occurs in ``ids`` (any shape), in no particular order."""
    values = ids.numpy(force=True) if isinstance(ids, torch.Tensor) else np.asarray(ids)
    return np.unique(values.ravel(), return_counts=True)[1]


def top_share(counts: np.ndarray, capacity: int) -> float:
    """The share of all accesses taken by the ``capacity`` largest of ``counts`` (per-id counts)."""
    check(capacity >= 0, "capacity", "a number of rows >= 0", capacity)
    counts = np.asarray(counts, dtype=np.int64)
    total = int(counts.sum())
    if total == 0:
        raise ValueError("no accesses: a hit rate needs at least one id")
    if capacity >= len(counts):
        return 1.0
    if capacity == 0:
        return 0.0
    # The capacity largest without a full sort: partition puts them after index len - capacity.
    largest = np.partition(counts, len(counts) - capacity)[len(counts) - capacity :]
    return int(largest.sum()) / total


def static_optimal_hit_rate(
    batches: Iterable[np.ndarray | torch.Tensor], capacity: int, *, unique_per_batch: bool = False
) -> float:
    """The share of the accesses of ``batches`` (id arrays of one table, in any shapes) that its
    ``capacity`` most frequent ids take: the hit rate of the best fixed set of ``capacity`` rows.

    ``unique_per_batch``: count an id once per batch, for a cache consulted once per distinct
    id of a batch (a fetch that deduplicates its ids first).
    """
    arrays = [
        b.numpy(force=True) if isinstance(b, torch.Tensor) else np.asarray(b) for b in batches
    ]
    if unique_per_batch:
        arrays = [np.unique(a) for a in arrays]
    flat = np.concatenate([a.ravel() for a in arrays]) if arrays else np.empty(0, np.int64)
    return top_share(id_counts(flat), capacity)


def fit_zipf_alpha(counts: np.ndarray, *, min_count: int = 10) -> float:
    """Maximum-likelihood Zipf exponent of per-id access ``counts`` (see the module docstring).

    Over the ``R`` ids seen at least ``min_count`` times, ranked by count, the likelihood of
    Zipf(α) truncated to ``R`` ranks is maximal where ``E_α[log rank]`` equals the observed mean
    log-rank; ``E_α`` falls as α grows, so bisection finds it. 0 for counts no more skewed than
    equal ones; uniform draws fit a small α all the same (65k draws over 2,000 ids: 0.14), since
    ranking ids by count orders their sampling noise. A ``ValueError`` when fewer than 2 ids
    reach ``min_count``.
    """
    check(min_count >= 1, "min_count", "an integer >= 1", min_count)
    head = np.sort(np.asarray(counts, dtype=np.float64))[::-1]
    head = head[head >= min_count]
    if len(head) < 2:
        raise ValueError(
            f"too few ids to fit a Zipf exponent: {len(head)} seen at least {min_count} times"
        )
    log_rank = np.log(np.arange(1, len(head) + 1, dtype=np.float64))
    observed = float((head * log_rank).sum() / head.sum())

    def expected(alpha: float) -> float:
        weights = np.exp(-alpha * log_rank)  # 1 at rank 1: the tail underflows, never overflows
        return float((weights * log_rank).sum() / weights.sum())

    low, high = 0.0, 1.0
    if observed >= expected(low):
        return 0.0
    while expected(high) > observed and high < 1e3:
        low, high = high, high * 2
    for _ in range(60):  # the interval shrinks 2^60 times: far below any sampling error
        middle = (low + high) / 2
        low, high = (middle, high) if expected(middle) > observed else (low, middle)
    return (low + high) / 2


__all__ = [
    "fit_zipf_alpha",
    "id_counts",
    "static_optimal_hit_rate",
    "top_share",
    "zipf_cdf",
    "zipf_ids",
]
