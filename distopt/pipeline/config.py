"""The ``pipeline:`` section of a job config."""

from __future__ import annotations

import dataclasses

from distopt.config import check


@dataclasses.dataclass(kw_only=True, slots=True)
class PipelineConfig:
    """Cross-iteration prefetch of the optimized model's remote reads (:mod:`distopt.pipeline`)."""

    enabled: bool = False
    """Issue each batch's remote reads during an earlier step (needs the optimized variant)."""
    staleness: int = 0
    """0: exact (reads issued after the previous step's pushes; bitwise equal to no pipeline).
    s >= 1: reads issued s steps ahead, before backward; a row misses at most s updates."""
    max_staleness: int | None = None
    """Deepen the staleness in the run, one step at a time while prefetched reads arrive late,
    up to this (``None``: keep ``staleness``). Needs ``staleness >= 1`` and a job that is not
    ``deterministic`` (the depth follows the host's timing)."""

    def __post_init__(self) -> None:
        check(
            isinstance(self.staleness, int)
            and not isinstance(self.staleness, bool)
            and self.staleness >= 0,
            "pipeline.staleness",
            "an integer >= 0",
            self.staleness,
        )
        limit = self.max_staleness
        check(
            limit is None
            or (
                isinstance(limit, int)
                and not isinstance(limit, bool)
                and limit >= max(1, self.staleness)
            ),
            "pipeline.max_staleness",
            f"an integer >= max(1, pipeline.staleness = {self.staleness}), or null",
            limit,
        )
