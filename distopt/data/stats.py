"""How skewed the ids of a Criteo-format click log are (``distopt data stats FILE``).

Per categorical feature ``C1..C26``: how many lines have a value, how many distinct values,
the Zipf exponent α fitted to their counts (:func:`distopt.models.ids.fit_zipf_alpha`:
maximum likelihood over the values seen at least ``min_count`` times) and the share of the
accesses its most frequent values take, for a cache of ``cache_fraction`` of them
(:func:`distopt.models.ids.top_share`). An empty field is missing, not a value (the reader
maps it to value 0; real logs have no value 0).

With a table layout (:class:`~distopt.data.criteo.TableLayout`: the model's tables, rows and
bag size) the same numbers per table, over the row ids the reader gives the model (hashed,
missing values and padding slots included): the skew a row cache of that table sees. The
reader's hash keeps a feature's counts (one value, one row) unless values collide, and many do
only where a table has fewer rows than its features have values: then every row also gets its
share of the long tail, which flattens the fitted α of the tail but not the head's share.

Counts are merged chunk by chunk, so memory follows the distinct values, not the lines.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import numpy as np

from distopt.config import check
from distopt.data.criteo import (
    NUM_CATEGORICAL,
    NUM_DENSE,
    TableLayout,
    field_name,
    line_chunks,
    parse_lines,
    scan,
)
from distopt.models.ids import fit_zipf_alpha, top_share


@dataclasses.dataclass(frozen=True, slots=True)
class IdStats:
    """The ids of one feature or table."""

    name: str
    """``C1`` .. ``C26``, or ``table 0`` ..."""
    accesses: int
    """Ids read: lines with a value (a feature), every id slot of every line (a table)."""
    distinct: int
    alpha: float | None
    """Fitted Zipf exponent; ``None`` when fewer than 2 ids were seen ``min_count`` times."""
    top_share: float
    """Share of ``accesses`` taken by the most frequent ``cache_fraction`` of the distinct ids:
    the static-optimal hit rate of a cache that size."""
    missing: float = 0.0
    """Share of lines without a value (features only)."""


class _Counts:
    """Counts of the values added so far, kept as sorted distinct values with their counts."""

    _MERGE_EVERY = 32

    def __init__(self) -> None:
        self._parts: list[tuple[np.ndarray, np.ndarray]] = []

    def add(self, values: np.ndarray) -> None:
        self._parts.append(np.unique(values, return_counts=True))
        if len(self._parts) >= self._MERGE_EVERY:
            self._parts = [self._merged()]

    def _merged(self) -> tuple[np.ndarray, np.ndarray]:
        if not self._parts:
            return np.empty(0, np.uint64), np.empty(0, np.int64)
        values = np.concatenate([v for v, _ in self._parts])
        counts = np.concatenate([c for _, c in self._parts])
        distinct, where = np.unique(values, return_inverse=True)
        return distinct, np.bincount(where, weights=counts).astype(np.int64)

    def counts(self) -> np.ndarray:
        return self._merged()[1]


def id_stats(
    name: str, counts: np.ndarray, *, min_count: int, cache_fraction: float, missing: float = 0.0
) -> IdStats:
    """:class:`IdStats` of per-id ``counts``."""
    try:
        alpha: float | None = fit_zipf_alpha(counts, min_count=min_count)
    except ValueError:
        alpha = None
    capacity = math.ceil(cache_fraction * len(counts))
    share = top_share(counts, capacity) if counts.sum() else 0.0
    return IdStats(
        name=name,
        accesses=int(counts.sum()),
        distinct=len(counts),
        alpha=alpha,
        top_share=share,
        missing=missing,
    )


def criteo_id_stats(
    path: str | Path,
    *,
    layout: TableLayout | None = None,
    max_lines: int | None = None,
    min_count: int = 10,
    cache_fraction: float = 0.02,
) -> tuple[list[IdStats], list[IdStats]]:
    """``(per feature, per table)`` id statistics of the first ``max_lines`` lines of ``path``
    (all by default); the per-table list is empty without a ``layout``."""
    check(max_lines is None or max_lines >= 1, "max_lines", "an integer >= 1", max_lines)
    check(min_count >= 1, "min_count", "an integer >= 1", min_count)
    check(0 < cache_fraction <= 1, "cache_fraction", "a fraction in (0, 1]", cache_fraction)
    path = Path(path)
    offsets = scan(path, key="FILE", max_lines=max_lines)
    lines = len(offsets) - 1
    features = [_Counts() for _ in range(NUM_CATEGORICAL)]
    tables = [_Counts() for _ in range(layout.num_tables if layout else 0)]
    for chunk in line_chunks(path, offsets):
        _, _, categorical = parse_lines(chunk)
        for j, feature in enumerate(features):
            column = categorical[:, j]
            feature.add(column[column != 0])
        if layout is not None:
            ids = layout.ids(categorical)
            for k, table in enumerate(tables):
                table.add(ids[:, k, :].ravel())
    per_feature = []
    for j, feature in enumerate(features):
        counts = feature.counts()
        per_feature.append(
            id_stats(
                field_name(1 + NUM_DENSE + j),
                counts,
                min_count=min_count,
                cache_fraction=cache_fraction,
                missing=1 - counts.sum() / lines,
            )
        )
    per_table = [
        id_stats(f"table {k}", t.counts(), min_count=min_count, cache_fraction=cache_fraction)
        for k, t in enumerate(tables)
    ]
    return per_feature, per_table


__all__ = ["IdStats", "criteo_id_stats", "id_stats"]
