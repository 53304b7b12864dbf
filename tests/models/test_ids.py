"""Skewed ids (distopt.models.ids): the Zipf sampler's distribution, the α fit, the static-optimal
hit rate against brute force, and DLRM batches drawing their ids from it."""

from __future__ import annotations

import itertools
import math
from collections import Counter

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from distopt.config import from_dict
from distopt.errors import ConfigError
from distopt.models.dlrm import DLRMConfig, make_batch
from distopt.models.ids import (
    fit_zipf_alpha,
    id_counts,
    static_optimal_hit_rate,
    top_share,
    zipf_cdf,
    zipf_ids,
)


def zipf_probabilities(num_rows: int, alpha: float) -> np.ndarray:
    weights = np.arange(1, num_rows + 1, dtype=np.float64) ** -alpha
    return weights / weights.sum()


@pytest.mark.parametrize("alpha", [0.6, 1.05, 1.5])
def test_zipf_ids_follow_zipf_within_five_standard_errors(alpha: float) -> None:
    num_rows, n = 1000, 200_000
    ids = zipf_ids((n,), num_rows=num_rows, alpha=alpha, generator=torch.Generator().manual_seed(7))
    assert ids.dtype == torch.int64 and 0 <= int(ids.min()) and int(ids.max()) < num_rows
    p = zipf_probabilities(num_rows, alpha)
    # Ids 0..9 one by one, then the tail in ranges: each bucket's share of the draws is a
    # binomial proportion with standard error sqrt(p (1 - p) / n).
    edges = [*range(11), 30, 100, 300, num_rows]
    counts = np.bincount(ids.numpy(), minlength=num_rows)
    for low, high in itertools.pairwise(edges):
        expected = float(p[low:high].sum())
        observed = counts[low:high].sum() / n
        sigma = math.sqrt(expected * (1 - expected) / n)
        assert abs(observed - expected) <= 5 * sigma, (low, high, observed, expected)


def test_zipf_ids_repeat_with_the_generator_and_keep_one_cumulative_per_table() -> None:
    def draw(seed: int) -> torch.Tensor:
        generator = torch.Generator().manual_seed(seed)
        return zipf_ids((3, 64, 4), num_rows=1_000_000, alpha=1.05, generator=generator)

    assert torch.equal(draw(1), draw(1)) and not torch.equal(draw(1), draw(2))
    cdf = zipf_cdf(1_000_000, 1.05)
    # The only state: 8 bytes a row, made once per (rows, α).
    assert cdf.dtype == torch.float64 and cdf.numel() == 1_000_000 and float(cdf[-1]) == 1.0
    assert zipf_cdf(1_000_000, 1.05) is cdf


@pytest.mark.parametrize("alpha", [0.6, 0.8, 1.05, 1.5])
def test_fit_recovers_alpha_from_generated_ids(alpha: float) -> None:
    ids = zipf_ids(
        (200_000,), num_rows=10_000, alpha=alpha, generator=torch.Generator().manual_seed(3)
    )
    # The MLE's standard error at n = 2e5 is about 0.003; 0.03 leaves room for the bias of
    # ranking ids by their observed counts.
    assert fit_zipf_alpha(id_counts(ids)) == pytest.approx(alpha, abs=0.03)


def test_fit_of_uniform_counts_is_zero_and_too_few_ids_is_an_error() -> None:
    assert fit_zipf_alpha(np.full(100, 50)) == pytest.approx(0.0, abs=1e-9)
    with pytest.raises(ValueError, match="too few ids to fit a Zipf exponent: 1 seen at least 10"):
        fit_zipf_alpha(np.array([100, 3, 2, 1]))


def brute_force_hit_rate(accesses: list[int], capacity: int) -> float:
    """The best share of ``accesses`` any set of ``capacity`` distinct ids covers, over every set."""
    distinct = sorted(set(accesses))
    best = max(
        sum(a in chosen for a in accesses)
        for chosen in map(set, itertools.combinations(distinct, min(capacity, len(distinct))))
    )
    return best / len(accesses)


@settings(max_examples=300, deadline=None)
@given(
    batches=st.lists(st.lists(st.integers(0, 7), min_size=1, max_size=8), min_size=1, max_size=5),
    capacity=st.integers(0, 9),
)
def test_static_optimal_hit_rate_is_the_best_fixed_set_of_rows(
    batches: list[list[int]], capacity: int
) -> None:
    flat = [i for batch in batches for i in batch]
    arrays = [torch.tensor(b) for b in batches]
    assert static_optimal_hit_rate(arrays, capacity) == pytest.approx(
        brute_force_hit_rate(flat, capacity), rel=1e-12
    )
    unique = [i for batch in batches for i in set(batch)]
    assert static_optimal_hit_rate(arrays, capacity, unique_per_batch=True) == pytest.approx(
        brute_force_hit_rate(unique, capacity), rel=1e-12
    )


def test_top_share_of_counts_and_its_errors() -> None:
    counts = np.array(list(Counter("aaaabbbcd").values()))
    assert top_share(counts, 2) == pytest.approx(7 / 9) and top_share(counts, 10) == 1.0
    with pytest.raises(ConfigError, match="capacity: expected a number of rows >= 0, got -1"):
        top_share(counts, -1)
    with pytest.raises(ValueError, match="no accesses"):
        static_optimal_hit_rate([], 3)


def test_dlrm_batches_draw_zipf_ids_when_asked_and_the_same_uniform_ids_otherwise() -> None:
    uniform = DLRMConfig(num_rows=1000, batch_size=256)
    gen = torch.Generator().manual_seed(uniform.seed * 1_000_003 + 5 * 7919)
    torch.randn(256, uniform.dense_features, generator=gen)
    before = torch.randint(0, 1000, (4, 256, 4), generator=gen)  # how ids were drawn before
    assert torch.equal(make_batch(uniform, 5).sparse, before)
    skewed = DLRMConfig(num_rows=1000, batch_size=256, id_alpha=1.05)
    ids = make_batch(skewed, 5).sparse
    assert ids.shape == (4, 256, 4) and int(ids.max()) < 1000
    assert static_optimal_hit_rate([ids], 20) > 0.3 > static_optimal_hit_rate([before], 20)


@pytest.mark.parametrize("bad", [0, -1.0, float("nan"), float("inf")])
def test_a_bad_id_alpha_is_one_line_naming_the_key(bad: float) -> None:
    with pytest.raises(ConfigError) as err:
        from_dict(DLRMConfig, {"id_alpha": bad})
    assert str(err.value) == (
        f"dlrm.id_alpha: expected a Zipf exponent > 0, or null for uniform ids, got {float(bad)!r}"
    )
