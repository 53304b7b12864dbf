"""Where a trainer's measurements go: its QPS log (JSON Lines, every trainer), TensorBoard scalars
(trainer 0) and the progress bar or log lines.

The JSON Lines log is the record of truth (``distopt compare`` reads it); TensorBoard gets the
same numbers for watching a run: ``train/loss``, ``train/qps``, ``train/lr``, ``train/wait_s``
(parameter-server jobs) per step, ``eval/loss``, ``eval/auc``, ``eval/perplexity`` per
evaluation, all at the global step (completed steps). Events go to
``<output_dir>/<run_id>/tensorboard``; ``tensorboard --logdir <output_dir>`` shows every run.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from pathlib import Path
from types import TracebackType
from typing import Any

from distopt.atomic import atomic_write_text
from distopt.errors import ConfigError
from distopt.metrics.qps_log import QpsLogWriter, iter_records
from distopt.pipeline.prefetch import PipelineStats
from distopt.ps.client.cache import FetchCounts
from distopt.training.evaluate import EvalResult
from distopt.training.progress import Progress

logger = logging.getLogger(__name__)


def summary_writer_class() -> Any:
    """``torch.utils.tensorboard.SummaryWriter``; a one-line error when the ``tensorboard``
    package is missing (``distopt.launch`` checks this before scheduling a job)."""
    try:
        # Imported here: tensorboard takes 0.15 s to import, and only jobs logging to it need it.
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as err:
        raise ConfigError(
            f"tensorboard: torch.utils.tensorboard is unavailable ({err}); install the "
            "tensorboard package or set tensorboard: false"
        ) from None
    return SummaryWriter


def tensorboard_writer(log_dir: Path) -> Any:
    """A ``torch.utils.tensorboard.SummaryWriter`` for ``log_dir`` (:func:`summary_writer_class`)."""
    return summary_writer_class()(log_dir=str(log_dir))


def kept_before(record: Mapping[str, Any], step: int) -> bool:
    """Whether a QPS log keeps ``record`` when the run goes back to ``step`` completed steps: the
    header, the steps before it, the evaluations up to it; not the footer."""
    kind = record.get("type")
    if kind == "step":
        return int(record["step"]) < step
    if kind == "eval":
        return int(record["step"]) <= step
    return kind == "header"


def reopen_log(path: Path, *, before_step: int) -> QpsLogWriter:
    """The QPS log at ``path``, its records from step ``before_step`` on dropped (they are run
    again), open to append. Used after an in-process recovery: unlike a resumed process, which
    starts a new log, the run's log goes on, and its footer says what was recovered."""
    kept = [r for _, r in iter_records(path) if kept_before(r, before_step)]
    if not kept or kept[0].get("type") != "header":
        raise ConfigError(f"QPS log {path}: no header to continue after a recovery")
    atomic_write_text(path, "".join(json.dumps(r) + "\n" for r in kept))
    head = kept[0]
    log = QpsLogWriter(
        path,
        path.open("a", encoding="utf-8"),
        run_id=head["run_id"],
        variant=head["variant"],
        rank=head["rank"],
        world_size=head["world_size"],
        global_batch_size=head["global_batch_size"],
    )
    log.steps_logged = sum(1 for r in kept if r["type"] == "step")
    return log


_PIPELINE_KEYS = ("staleness_max", "staleness_mean", "prefetch_bytes")


class Recorder:
    """Fans one trainer's step and evaluation records out to the log, TensorBoard and progress."""

    def __init__(self, log: QpsLogWriter, progress: Progress, board: Any = None) -> None:
        self.log = log
        self.progress = progress
        self.board = board

    @property
    def path(self) -> Path:
        return self.log.path

    def step(
        self,
        step: int,
        step_time_s: float,
        *,
        loss: float,
        lr: float,
        wait_s: float | None,
        pipeline: PipelineStats | None = None,
        phases: Mapping[str, float] | None = None,
        fetched: FetchCounts | None = None,
        cached: bool = False,
    ) -> None:
        """One step's record; ``fetched``: what the step's fetches took (parameter-server jobs),
        ``cached``: whether the job has row caches (their fields are logged then)."""
        extra: dict[str, float] = {}
        if pipeline is not None:
            extra = {
                "staleness_max": pipeline.staleness_max,
                "staleness_mean": pipeline.staleness_mean,
                "prefetch_bytes": pipeline.inflight_bytes_max,
            }
        if fetched is not None:
            extra["rows_fetched"] = fetched.rows
            extra["bytes_fetched"] = fetched.bytes
            if cached:
                if fetched.hit_rate is not None:
                    extra["cache_hit_rate"] = fetched.hit_rate
                extra["cache_bytes"] = fetched.cache_bytes
                extra["cache_staleness_max"] = fetched.staleness_max
        record = self.log.log_step(
            step, step_time_s, loss=loss, lr=lr, wait_s=wait_s, phases=phases, **extra
        )
        self.progress.update(step, loss=loss, qps=record.qps)
        if self.board is not None:
            done = step + 1
            self.board.add_scalar("train/loss", loss, done)
            self.board.add_scalar("train/qps", record.qps, done)
            self.board.add_scalar("train/lr", lr, done)
            if wait_s is not None:
                self.board.add_scalar("train/wait_s", wait_s, done)
            for key, value in extra.items():
                group = "pipeline" if key in _PIPELINE_KEYS else "fetch"
                self.board.add_scalar(f"{group}/{key}", value, done)

    def evaluation(self, done: int, result: EvalResult, seconds: float) -> None:
        metrics = result.as_dict()
        self.log.log_eval(done, metrics, eval_time_s=seconds)
        shown = " ".join(f"{k.removeprefix('eval_')} {v:.4g}" for k, v in metrics.items())
        self.progress.note(f"eval after step {done}: {shown} ({seconds:.1f} s)")
        if self.board is not None:
            for key, value in metrics.items():
                if key != "eval_samples":
                    self.board.add_scalar(f"eval/{key.removeprefix('eval_')}", value, done)

    def close(self, *, error: BaseException | None = None) -> None:
        self.progress.close()
        if self.board is not None:
            self.board.close()
            self.board = None
        if error is None:
            self.log.close()
        else:
            self.log.close(status="failed", error=f"{type(error).__name__}: {error}")

    def __enter__(self) -> Recorder:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close(error=exc)


__all__ = ["Recorder", "kept_before", "reopen_log", "tensorboard_writer"]
