"""The benchmarks' turn order: every variant follows every other about equally often."""

from __future__ import annotations

from collections import Counter

import pytest

from distopt.bench.order import balanced_orders


def _follows(orders: list[list[str]], turns: str) -> Counter[tuple[str, str]]:
    """How often each variant ran right after each other, as the rounds run."""
    counts: Counter[tuple[str, str]] = Counter()
    last = None
    for order in orders:
        sequence = ([last] if last is not None and turns == "chunks" else []) + order
        counts.update(zip(sequence, sequence[1:], strict=False))
        if turns == "steps":
            counts[order[-1], order[0]] += 1
        last = order[-1]
    return counts


@pytest.mark.parametrize("turns", ["chunks", "steps"])
@pytest.mark.parametrize("n", [2, 3, 4, 5, 6])
@pytest.mark.parametrize("rounds", [8, 21, 80])
def test_every_variant_follows_every_other_about_equally_often(
    n: int, rounds: int, turns: str
) -> None:
    variants = [f"v{i}" for i in range(n)]
    orders = balanced_orders(variants, rounds, turns=turns)  # type: ignore[arg-type]
    assert len(orders) == rounds
    assert all(sorted(order) == variants for order in orders)
    counts = _follows(orders, turns)
    assert all(before != after for before, after in counts)  # never a variant after itself
    pairs = [counts[a, b] for a in variants for b in variants if a != b]
    # Greedy, so not always exact (and for 4 or 6 variants in step-by-step rounds no order is:
    # their complete digraphs have no decomposition into Hamiltonian cycles).
    assert max(pairs) - min(pairs) <= 2


def test_a_rotated_order_is_what_it_replaces_and_is_not_balanced() -> None:
    # Rotations of one order keep its cycle: in step-by-step rounds the second variant always ran
    # right after the first (remote_idioms' optimized model after the model as written).
    variants = ["baseline", "optimized", "hand"]
    rotated = [variants[r % 3 :] + variants[: r % 3] for r in range(6)]
    assert _follows(rotated, "steps")["hand", "optimized"] == 0
    balanced = _follows(balanced_orders(variants, 6, turns="steps"), "steps")
    assert balanced["hand", "optimized"] == balanced["baseline", "optimized"] == 3
