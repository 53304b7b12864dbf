"""The order in which a benchmark's variants take turns, balanced for what ran just before.

A variant's chunk (or step) pays for what the one before it left behind: a model as written
that blocks on every push, a loader that just warmed the page cache. Rotating one order each
round (``[a, b, c]``, ``[b, c, a]``, ...) keeps the cycle ``a → b → c → a``: ``b`` follows ``a``
almost always. Measured on ps_overlap's Ray point K = 1, 5 ms, heavy (30 rounds of 30 steps):
the hand-written model run in the optimized model's turn, against itself in its own turn, scored
H = 0.86 and was slower in 18 of 30 rounds; the optimized model scored 0.70, slower in 22.

:func:`balanced_orders` picks each round's order so that every variant follows every other
about equally often (a serially balanced sequence, built greedily: the counts stay within 2 of
each other), and takes each place in the round about equally often.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Sequence
from typing import Literal

Turns = Literal["chunks", "steps"]
"""How a round runs its order: ``chunks``, each variant once (the next round's first follows
this round's last); ``steps``, the order repeated once per step (its last followed by its first)."""

_EXHAUSTIVE = 6
"""Up to this many variants each round's order is chosen among all permutations (720)."""


def balanced_orders(variants: Sequence[str], rounds: int, *, turns: Turns) -> list[list[str]]:
    """``rounds`` orders of ``variants``, each a permutation, chosen one after another so that the
    counts of "``x`` right after ``y``" stay as even as they can (then the counts of places)."""
    names = list(variants)
    if len(names) < 2:
        return [list(names) for _ in range(rounds)]
    follows: Counter[tuple[str, str]] = Counter()
    places: Counter[tuple[str, int]] = Counter()
    orders: list[list[str]] = []
    last: str | None = None
    for round_index in range(rounds):
        if len(names) > _EXHAUSTIVE:
            # Rotations, every other one reversed: each variant has both neighbours before it.
            shift = round_index % len(names)
            rotated = names[shift:] + names[:shift]
            candidates: Sequence[tuple[str, ...]] = [
                tuple(reversed(rotated)) if (round_index // len(names)) % 2 else tuple(rotated)
            ]
        else:
            candidates = list(itertools.permutations(names))

        best = min(
            candidates, key=lambda order: _cost(order, _pairs(order, last, turns), follows, places)
        )
        follows.update(_pairs(best, last, turns))
        places.update((name, i) for i, name in enumerate(best))
        orders.append(list(best))
        last = best[-1]
    return orders


def _cost(
    order: Sequence[str],
    pairs: list[tuple[str, str]],
    follows: Counter[tuple[str, str]],
    places: Counter[tuple[str, int]],
) -> tuple[int, int, int]:
    """How uneven the counts get with ``order`` next: a variant right after itself first (never
    wanted), then the squares of the "after" counts, then of the places."""
    repeats = sum(before == after for before, after in pairs)
    counts = Counter(follows)
    counts.update(pairs)
    spread = sum(c * c for (before, after), c in counts.items() if before != after)
    place_spread = sum((places[name, i] + 1) ** 2 for i, name in enumerate(order))
    return repeats, spread, place_spread


def _pairs(order: Sequence[str], last: str | None, turns: Turns) -> list[tuple[str, str]]:
    """``(before, after)`` for each turn that follows another in a round run as ``turns``."""
    pairs = list(itertools.pairwise(order))
    if turns == "steps":
        pairs.append((order[-1], order[0]))
    elif last is not None:
        pairs.append((last, order[0]))
    return pairs
