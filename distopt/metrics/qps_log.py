"""QPS logs: one JSON Lines file per trainer rank, a header record then one record per step
(with the step's loss, learning rate and remote wait when the trainer knows them) and one per
held-out evaluation.

Layout: ``<output_dir>/<run_id>/qps-rank<r>.jsonl``. The format is documented in
``docs/qps_log_format.md``; :data:`FORMAT_VERSION` is bumped on incompatible changes.

Writing (one writer per trainer rank; every line is flushed so a crashed job keeps its steps)::

    with QpsLogWriter.create("runs", run_id="r1", variant="baseline", rank=0, world_size=2,
                             global_batch_size=64, config=to_dict(job)) as log:
        log.log_step(0, step_time_s=0.012, loss=0.69, lr=0.01)
        log.log_eval(100, {"eval_loss": 0.52, "eval_auc": 0.78}, eval_time_s=1.2)

Reading (a run directory or a single rank file)::

    run = load_run("runs/r1")
    run.merged_steps()  # global QPS per step = global_batch_size / max step time over ranks
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import socket
import subprocess
import time
from collections.abc import Iterator, Mapping
from importlib.metadata import version
from pathlib import Path
from types import TracebackType
from typing import Any, TextIO

import torch

from distopt.metrics.records import (
    FORMAT_VERSION,
    LOG_GLOB,
    EvalRecord,
    QpsLogError,
    RankLog,
    RunLog,
    StepRecord,
    log_path,
)

# --- environment of the header -------------------------------------------------------------------


def git_revision(cwd: str | Path | None = None) -> str | None:
    """The commit hash of the checkout at ``cwd`` (default: distopt's source tree), or None."""
    where = Path(cwd) if cwd is not None else Path(__file__).resolve().parent
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            cwd=where,
            capture_output=True,
            text=True,
            timeout=5,
            check=False,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    rev = out.stdout.strip()
    return rev if out.returncode == 0 and rev else None


def environment_info() -> dict[str, Any]:
    """Versions and host facts recorded in every header."""
    try:
        distopt_version: str | None = version("distopt")
    except Exception:  # not installed as a distribution (e.g. a bare source tree)
        distopt_version = None
    return {
        "git_revision": git_revision(),
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "distopt": distopt_version,
        },
        "host": {
            "hostname": socket.gethostname(),
            "platform": platform.platform(),
            "machine": platform.machine(),
            "cpu_count": os.cpu_count(),
            "pid": os.getpid(),
        },
    }


# --- writer --------------------------------------------------------------------------------------


class QpsLogWriter:
    """Appends JSON Lines records for one trainer rank, flushing after every line."""

    def __init__(
        self,
        path: Path,
        stream: TextIO,
        *,
        run_id: str,
        variant: str,
        rank: int,
        world_size: int,
        global_batch_size: int,
    ) -> None:
        self.path = path
        self._stream = stream
        self.run_id = run_id
        self.variant = variant
        self.rank = rank
        self.world_size = world_size
        self.global_batch_size = global_batch_size
        self.steps_logged = 0
        self.footer: dict[str, Any] = {}
        """More keys for the footer (e.g. a recovered run's ``recoveries``)."""

    @classmethod
    def create(
        cls,
        output_dir: str | Path,
        *,
        run_id: str,
        variant: str,
        rank: int,
        world_size: int,
        global_batch_size: int,
        config: Mapping[str, Any],
        extra: Mapping[str, Any] | None = None,
        start_time: float | None = None,
    ) -> QpsLogWriter:
        """Open ``<output_dir>/<run_id>/qps-rank<rank>.jsonl`` and write the header.

        A log already there (an earlier attempt of a restarted or requeued job, or a rerun of the
        same run id) is kept as ``qps-rank<rank>.jsonl.1`` (older ones shift to ``.2``, ...), as
        :class:`logging.handlers.RotatingFileHandler` names them; readers of the run see only the
        newest.

        ``extra`` adds header keys, e.g. the cost model's ``predicted_step_time_s`` or
        ``predicted_gain``; it may not override the standard keys.
        """
        path = log_path(output_dir, run_id, rank)
        path.parent.mkdir(parents=True, exist_ok=True)
        _keep_earlier(path)
        header: dict[str, Any] = {
            "type": "header",
            "format_version": FORMAT_VERSION,
            "run_id": run_id,
            "variant": variant,
            "rank": rank,
            "world_size": world_size,
            "global_batch_size": global_batch_size,
            "start_time": time.time() if start_time is None else start_time,
            "config": dict(config),
            **environment_info(),
        }
        for key, value in (extra or {}).items():
            if key in header:
                raise QpsLogError(f"header key {key!r} is reserved and cannot be set through extra")
            header[key] = value
        stream = path.open("w", encoding="utf-8")
        writer = cls(
            path,
            stream,
            run_id=run_id,
            variant=variant,
            rank=rank,
            world_size=world_size,
            global_batch_size=global_batch_size,
        )
        writer._write(header)
        return writer

    def log_step(
        self,
        step: int,
        step_time_s: float,
        *,
        timestamp: float | None = None,
        loss: float | None = None,
        lr: float | None = None,
        wait_s: float | None = None,
        phases: Mapping[str, float] | None = None,
        **pipeline: float,
    ) -> StepRecord:
        """Record one step of this rank; ``qps`` is derived from the global batch size. The
        optional values (``pipeline``: ``staleness_max``, ``staleness_mean``, ``prefetch_bytes``,
        and the fetch counts ``rows_fetched``, ``bytes_fetched``, ``cache_*``; ``phases``:
        seconds by step phase) are written only when given."""
        if step_time_s <= 0:
            raise QpsLogError(f"step {step}: step_time_s must be > 0, got {step_time_s!r}")
        record = StepRecord(
            run_id=self.run_id,
            variant=self.variant,
            step=step,
            rank=self.rank,
            world_size=self.world_size,
            global_batch_size=self.global_batch_size,
            step_time_s=step_time_s,
            qps=self.global_batch_size / step_time_s,
            timestamp=time.time() if timestamp is None else timestamp,
            loss=loss,
            lr=lr,
            wait_s=wait_s,
            phases=dict(phases) if phases is not None else None,
            **pipeline,
        )
        fields = {k: v for k, v in dataclasses.asdict(record).items() if v is not None}
        self._write({"type": "step", **fields})
        self.steps_logged += 1
        return record

    def log_eval(
        self, step: int, metrics: Mapping[str, float | int], *, eval_time_s: float
    ) -> EvalRecord:
        """Record a held-out evaluation after ``step`` completed steps."""
        record = EvalRecord(
            step=step, rank=self.rank, eval_time_s=eval_time_s, metrics=dict(metrics)
        )
        self._write(
            {
                "type": "eval",
                "run_id": self.run_id,
                "step": step,
                "rank": self.rank,
                "eval_time_s": eval_time_s,
                **record.metrics,
            }
        )
        return record

    def close(self, *, status: str = "ok", error: str | None = None) -> None:
        """Write the footer and close the file (idempotent)."""
        if self._stream.closed:
            return
        footer: dict[str, Any] = {
            "type": "footer",
            "steps": self.steps_logged,
            "end_time": time.time(),
            "status": status,
            **self.footer,
        }
        if error is not None:
            footer["error"] = error
        self._write(footer)
        self._stream.close()

    def _write(self, record: Mapping[str, Any]) -> None:
        self._stream.write(json.dumps(record, sort_keys=False) + "\n")
        self._stream.flush()

    def __enter__(self) -> QpsLogWriter:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc is None:
            self.close()
        else:
            self.close(status="failed", error=f"{type(exc).__name__}: {exc}")


def _keep_earlier(path: Path) -> None:
    """Shift ``path`` (if it has content) to ``path.1``, an existing ``.1`` to ``.2``, and so on."""
    if not path.exists() or path.stat().st_size == 0:
        return
    kept = sorted(
        (int(p.name.rsplit(".", 1)[1]), p)
        for p in path.parent.glob(f"{path.name}.*")
        if p.name.rsplit(".", 1)[1].isdigit()
    )
    for number, older in reversed(kept):
        older.rename(path.with_name(f"{path.name}.{number + 1}"))
    path.rename(path.with_name(f"{path.name}.1"))


# --- reader --------------------------------------------------------------------------------------

_HEADER_FIELDS: dict[str, type | tuple[type, ...]] = {
    "format_version": int,
    "run_id": str,
    "variant": str,
    "rank": int,
    "world_size": int,
    "global_batch_size": int,
    "start_time": (int, float),
    "config": dict,
}
_FIELD_TYPES: dict[str, type | tuple[type, ...]] = {"str": str, "int": int, "float": (int, float)}
_STEP_FIELDS: dict[str, type | tuple[type, ...]] = {
    f.name: _FIELD_TYPES[str(f.type)]
    for f in dataclasses.fields(StepRecord)
    if str(f.type) in _FIELD_TYPES
}
_STEP_OPTIONAL = (
    "loss",
    "lr",
    "wait_s",
    "staleness_max",
    "staleness_mean",
    "prefetch_bytes",
    "rows_fetched",
    "bytes_fetched",
    "cache_hit_rate",
    "cache_bytes",
    "cache_staleness_max",
)
_EVAL_FIELDS: dict[str, type | tuple[type, ...]] = {
    "step": int,
    "rank": int,
    "eval_time_s": (int, float),
}
_RECORD_TYPES = ("header", "step", "eval", "footer")


def _check_fields(
    record: Mapping[str, Any], fields: Mapping[str, type | tuple[type, ...]], where: str
) -> None:
    for name, tp in fields.items():
        if name not in record:
            raise QpsLogError(f"{where}: {record['type']} record lacks {name!r}")
        value = record[name]
        if isinstance(value, bool) or not isinstance(value, tp):
            raise QpsLogError(f"{where}: {record['type']} field {name!r} has bad value {value!r}")


def iter_records(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    """``(line number, record)`` of every record of the log at ``path``, checked for its type."""
    with path.open(encoding="utf-8") as stream:
        for lineno, line in enumerate(stream, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise QpsLogError(f"{path}:{lineno}: not valid JSON ({err.msg})") from None
            if not isinstance(record, dict) or record.get("type") not in _RECORD_TYPES:
                raise QpsLogError(
                    f"{path}:{lineno}: expected an object with type header/step/eval/footer, "
                    f"got {line.strip()[:80]!r}"
                )
            yield lineno, record


def read_log(path: str | Path) -> RankLog:
    """Parse and validate one rank's log file."""
    path = Path(path)
    if not path.is_file():
        raise QpsLogError(f"QPS log not found: {path}")
    header: dict[str, Any] | None = None
    footer: dict[str, Any] | None = None
    steps: list[StepRecord] = []
    evals: list[EvalRecord] = []
    for lineno, record in iter_records(path):
        where = f"{path}:{lineno}"
        kind = record["type"]
        if header is None and kind != "header":
            raise QpsLogError(f"{where}: the first record must be the header, got {kind!r}")
        if footer is not None:
            raise QpsLogError(f"{where}: {kind} record after the footer")
        if kind == "header":
            if header is not None:
                raise QpsLogError(f"{where}: a second header record")
            _check_fields(record, _HEADER_FIELDS, where)
            if record["format_version"] > FORMAT_VERSION:
                raise QpsLogError(
                    f"{where}: format_version {record['format_version']} is newer than this "
                    f"distopt reads ({FORMAT_VERSION})"
                )
            header = record
        elif kind == "step":
            assert header is not None  # the first record is a header (checked above)
            _check_fields(record, _STEP_FIELDS, where)
            if record["run_id"] != header["run_id"] or record["rank"] != header["rank"]:
                raise QpsLogError(
                    f"{where}: step record of run {record['run_id']!r} rank {record['rank']} in the "
                    f"log of run {header['run_id']!r} rank {header['rank']}"
                )
            if record["step_time_s"] <= 0:
                raise QpsLogError(
                    f"{where}: step_time_s must be > 0, got {record['step_time_s']!r}"
                )
            fields: dict[str, Any] = {name: record[name] for name in _STEP_FIELDS}
            fields.update({name: _optional_float(record, name, where) for name in _STEP_OPTIONAL})
            fields["phases"] = _phases(record, where)
            steps.append(StepRecord(**fields))
        elif kind == "eval":
            _check_fields(record, _EVAL_FIELDS, where)
            metrics = {
                k: v for k, v in record.items() if k.startswith("eval_") and k != "eval_time_s"
            }
            evals.append(
                EvalRecord(
                    step=record["step"],
                    rank=record["rank"],
                    eval_time_s=record["eval_time_s"],
                    metrics=metrics,
                )
            )
        else:
            footer = record
    if header is None:
        raise QpsLogError(f"{path}: empty QPS log (no header record)")
    return RankLog(path=path, header=header, steps=tuple(steps), footer=footer, evals=tuple(evals))


def _optional_float(record: Mapping[str, Any], name: str, where: str) -> float | None:
    value = record.get(name)
    if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
        raise QpsLogError(f"{where}: step field {name!r} has bad value {value!r}")
    return value


def _phases(record: Mapping[str, Any], where: str) -> dict[str, float] | None:
    value = record.get("phases")
    if value is None:
        return None
    if not isinstance(value, dict) or any(
        isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0 for v in value.values()
    ):
        raise QpsLogError(f"{where}: step field 'phases' has bad value {value!r}")
    return {str(k): float(v) for k, v in value.items()}


def load_run(path: str | Path) -> RunLog:
    """Load a run directory (every ``qps-rank*.jsonl`` in it) or a single rank file.

    Raises :class:`QpsLogError` when the path is missing, holds no logs, a log has no steps, or the
    rank files disagree on run id or world size.
    """
    path = Path(path)
    if path.is_dir():
        files = sorted(path.glob(LOG_GLOB))
        if not files:
            raise QpsLogError(f"no QPS logs ({LOG_GLOB}) in run directory {path}")
    elif path.is_file():
        files = [path]
    else:
        raise QpsLogError(f"run not found: {path}")
    ranks: dict[int, RankLog] = {}
    for file in files:
        rank_log = read_log(file)
        rank = rank_log.header["rank"]
        if rank in ranks:
            raise QpsLogError(f"{file}: rank {rank} also logged in {ranks[rank].path}")
        if not rank_log.steps:
            raise QpsLogError(f"{file}: no step records")
        ranks[rank] = rank_log
    first = ranks[min(ranks)]
    for rank_log in ranks.values():
        for key in ("run_id", "world_size", "global_batch_size"):
            if rank_log.header[key] != first.header[key]:
                raise QpsLogError(
                    f"{rank_log.path}: {key} {rank_log.header[key]!r} differs from "
                    f"{first.header[key]!r} in {first.path}"
                )
    return RunLog(path=path, ranks=ranks)
