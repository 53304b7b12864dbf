"""The records of QPS logs (:mod:`distopt.metrics.qps_log` writes and reads them): a step, a
held-out evaluation, one rank's log, a run's logs and its merged global steps.

The format is documented in ``docs/qps_log_format.md``; :data:`FORMAT_VERSION` is bumped on
incompatible changes.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from distopt.errors import DistoptError

FORMAT_VERSION = 2
"""2 added ``eval`` records and the optional ``loss``, ``lr`` and ``wait_s`` of step records;
version 1 logs read as before."""
LOG_GLOB = "qps-rank*.jsonl"


class QpsLogError(DistoptError):
    """A QPS log is missing, empty or malformed; the message names ``file:line``."""


def log_path(output_dir: str | Path, run_id: str, rank: int) -> Path:
    """Where rank ``rank`` of run ``run_id`` writes its QPS log."""
    return Path(output_dir) / run_id / f"qps-rank{rank}.jsonl"


# --- records -------------------------------------------------------------------------------------


@dataclasses.dataclass(kw_only=True, slots=True, frozen=True)
class StepRecord:
    """One training step as seen by one trainer rank."""

    run_id: str
    variant: str
    step: int
    """0-based step index; the same step on every rank."""
    rank: int
    """Trainer rank (parameter servers write no logs)."""
    world_size: int
    """Number of trainer ranks."""
    global_batch_size: int
    """Samples consumed by the whole job in this step (all trainers together)."""
    step_time_s: float
    """Wall time of this rank's step (forward, backward, optimizer, pushes issued), seconds."""
    qps: float
    """``global_batch_size / step_time_s``: job throughput if every rank were as fast as this one."""
    timestamp: float
    """Unix time (seconds) at the end of the step."""
    loss: float | None = None
    """Training loss of this rank's step (mean over its micro-batches), when logged."""
    lr: float | None = None
    """Learning rate the step's optimizer update used, when logged."""
    wait_s: float | None = None
    """Seconds this rank spent blocked waiting for remote (parameter-server) calls, when logged."""
    staleness_max: float | None = None
    """Pipelined runs: the most updates a prefetched row missed, over the run so far."""
    staleness_mean: float | None = None
    """Pipelined runs: updates missed per prefetched row, mean over the run so far."""
    prefetch_bytes: float | None = None
    """Pipelined runs: peak bytes of prefetched rows waiting for their step, over the run so far."""
    rows_fetched: float | None = None
    """Parameter-server jobs: rows the servers sent this rank's fetches in the step."""
    bytes_fetched: float | None = None
    """Parameter-server jobs: bytes of the tensors those answers held (rows; with a cache also
    optimizer state and versions)."""
    cache_hit_rate: float | None = None
    """Jobs with row caches (``ps.cache``): the share of the step's fetched ids served from a
    cache (absent in a step that looked none up)."""
    cache_bytes: float | None = None
    """Jobs with row caches: the memory the caches take."""
    cache_staleness_max: float | None = None
    """Jobs with row caches: the most updates of other trainers a row served from a cache had
    missed, over the run so far (0 under ``consistency: exact``)."""
    phases: dict[str, float] | None = None
    """Seconds of each phase of the step (:data:`distopt.estimate.step.LOGGED`), when logged."""


@dataclasses.dataclass(kw_only=True, slots=True, frozen=True)
class EvalRecord:
    """One held-out evaluation, as seen by one trainer rank (metrics are over all ranks)."""

    step: int
    """Training steps completed before the evaluation."""
    rank: int
    eval_time_s: float
    metrics: dict[str, float | int]
    """``eval_loss``, ``eval_samples`` and, by task, ``eval_auc`` or ``eval_perplexity``."""


@dataclasses.dataclass(kw_only=True, slots=True, frozen=True)
class RankLog:
    """The parsed contents of one ``qps-rank<r>.jsonl`` file."""

    path: Path
    header: dict[str, Any]
    steps: tuple[StepRecord, ...]
    footer: dict[str, Any] | None
    evals: tuple[EvalRecord, ...] = ()


@dataclasses.dataclass(kw_only=True, slots=True, frozen=True)
class MergedStep:
    """One step of the whole job: the slowest rank sets the pace."""

    step: int
    step_time_s: float
    """Max over ranks of their step time (synchronous training waits for the slowest rank)."""
    qps: float
    """``global_batch_size / step_time_s``."""
    timestamp: float
    """Latest end-of-step timestamp over ranks."""


@dataclasses.dataclass(kw_only=True, slots=True, frozen=True)
class RunLog:
    """All rank logs of one run."""

    path: Path
    ranks: dict[int, RankLog]

    @property
    def header(self) -> dict[str, Any]:
        """The lowest rank's header (config, versions and host are the same on every rank)."""
        return self.ranks[min(self.ranks)].header

    @property
    def run_id(self) -> str:
        return str(self.header["run_id"])

    @property
    def variant(self) -> str:
        return str(self.header["variant"])

    @property
    def config(self) -> dict[str, Any]:
        return dict(self.header["config"])

    @property
    def world_size(self) -> int:
        return int(self.header["world_size"])

    def merged_steps(self) -> list[MergedStep]:
        """Global steps, sorted, keeping only steps that every rank present in the run logged.

        A step missing on some rank (a rank that crashed, a log cut short) has no well-defined job
        step time, so it is left out rather than guessed.
        """
        by_step: dict[int, list[StepRecord]] = {}
        for rank_log in self.ranks.values():
            for rec in rank_log.steps:
                by_step.setdefault(rec.step, []).append(rec)
        merged = []
        for step in sorted(by_step):
            recs = by_step[step]
            if len(recs) != len(self.ranks):
                continue
            slowest = max(r.step_time_s for r in recs)
            merged.append(
                MergedStep(
                    step=step,
                    step_time_s=slowest,
                    qps=recs[0].global_batch_size / slowest,
                    timestamp=max(r.timestamp for r in recs),
                )
            )
        return merged
