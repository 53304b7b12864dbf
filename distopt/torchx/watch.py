"""What a launched job is doing and, when it failed, which process failed first and why.

Both read what TorchX already records, through its runner: ``runner.log_lines`` tails a replica's
log (as ``torchx run`` and ``torchx log`` do), ``runner.describe`` gives the app's roles, and
``runner.status`` where its logs are (``ui_url``). On ``local_cwd`` TorchX also writes, once the
app has ended, ``SUCCESS`` in the app's log directory: every replica's exit code and log files.
Each ``distopt.train`` process records its failure in torchelastic's error file (see
:func:`distopt.train.main`), as ``torchrun`` does for its workers; the first replica to fail is
the one whose error file was written first, as TorchX's own ``structured_error_msg`` takes it.
"""

from __future__ import annotations

import dataclasses
import json
import re
import signal
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TextIO
from urllib.parse import urlparse

TAIL_LINES = 12
"""Lines of the failing replica's log shown before its error line."""

_ERROR_LINE = re.compile(
    r"^(\[rank\d+\]:\s*)?([A-Za-z_][\w.]*(Error|Exception|Interrupt)\b.*|\S+: error: .*)$"
)
_RANK = re.compile(r"^\[rank(\d+)\]:")
_NOT_A_CAUSE = re.compile(
    r"^(slurmstepd(-\S+)?: error: \*\*\* (STEP|JOB) \S+ ON \S+ CANCELLED"
    r"|torch\.distributed\.elastic\.multiprocessing\.errors\.ChildFailedError\b)"
)
"""Lines a launcher adds after a process failed (Slurm ending the step, torchrun's exception
saying a worker failed): the consequence, not the cause, which is the error line before them."""


@dataclasses.dataclass(kw_only=True, slots=True)
class Replica:
    """One process of a finished app, as TorchX recorded it."""

    role: str
    index: int
    exit_code: int | None
    """``None`` where the scheduler keeps no exit codes (only ``local_cwd`` writes them)."""
    state: str | None = None
    """The scheduler's state of the replica (``FAILED``...) where it has no exit code."""
    stdout: Path | None = None
    stderr: Path | None = None
    error_file: Path | None = None

    @property
    def name(self) -> str:
        return f"{self.role} {self.index}"

    @property
    def failed(self) -> bool:
        return self.exit_code not in (0, None) or self.state == "FAILED"

    def exit_text(self) -> str:
        if self.exit_code is None:
            return f"{self.state or 'state unknown'}, exit code unknown"
        if self.exit_code < 0:
            try:
                return f"killed by {signal.Signals(-self.exit_code).name}"
            except ValueError:
                return f"killed by signal {-self.exit_code}"
        return f"exit code {self.exit_code}"


@dataclasses.dataclass(kw_only=True, slots=True)
class Failure:
    """The first replica of a failed app to fail, its error and the end of its log."""

    handle: str
    state: str
    replica: Replica | None
    """``None``: the scheduler said why the app failed, not which replica (``message``)."""
    error: str
    """The one-line error: from the replica's error file, else its log's last error line."""
    rank: int | None = None
    """The torchrun worker that failed inside the replica (``[rank1]:`` lines), if any."""
    tail: tuple[str, ...] = ()
    others: tuple[Replica, ...] = ()
    """Replicas that failed after it (usually because of it)."""
    log_dir: Path | None = None

    def format(self) -> str:
        """Several lines: what failed, its error, the end of its log, where the logs are."""
        if self.replica is None:
            lines = [f"{self.handle}: {self.state}: {self.error}"]
        else:
            # A torchrun replica holds several ranks; elsewhere the rank is the replica's index.
            inner = self.rank is not None and self.rank != self.replica.index
            where = self.replica.name + (f" (rank {self.rank})" if inner else "")
            lines = [
                f"{self.handle}: {self.state}: {where} failed first ({self.replica.exit_text()}): {self.error}"
            ]
        if self.tail and self.replica is not None:
            lines.append(
                f"  last lines of {self.replica.stderr or f'{self.replica.role}/{self.replica.index}'}:"
            )
            lines += [f"    {line}" for line in self.tail]
        if self.others:
            lines.append("  then: " + ", ".join(f"{r.name} ({r.exit_text()})" for r in self.others))
        if self.log_dir is not None:
            lines.append(f"  logs: {self.log_dir}/<role>/<replica>/{{stderr,stdout}}.log")
        return "\n".join(lines)


def stream(
    runner: Any, handle: str, *, role: str = "trainer", replica: int = 0, file: TextIO | None = None
) -> threading.Thread:
    """Print ``role``'s replica ``replica`` log lines as they come, prefixed ``role/replica``, on a
    daemon thread that ends with the app (``runner.log_lines(..., should_tail=True)``, what
    ``torchx run`` does on local schedulers). Join it after ``runner.wait``."""
    out = sys.stderr if file is None else file
    prefix = f"{role}/{replica} "

    def tail() -> None:
        try:
            for line in runner.log_lines(handle, role, replica, should_tail=True):
                print(prefix + line.rstrip("\n"), file=out, flush=True)
        except Exception as err:  # a scheduler without logs: the job goes on, unstreamed
            print(
                f"{prefix}(no log to stream: {str(err).strip().splitlines()[0]})",
                file=out,
                flush=True,
            )

    thread = threading.Thread(target=tail, name=f"distopt-stream-{role}-{replica}", daemon=True)
    thread.start()
    return thread


def failure(runner: Any, handle: str, status: Any) -> Failure:
    """What made the app of ``handle`` (ended in ``status``) fail: see the module docstring."""
    state = getattr(
        getattr(status, "state", None), "name", str(getattr(status, "state", "UNKNOWN"))
    )
    log_dir = _log_dir(status)
    replicas = _replicas(runner, handle, status, log_dir)
    failed = [r for r in replicas if r.failed]
    if not failed:
        message = (getattr(status, "msg", "") or "").strip() or "no replica reported an error"
        return Failure(
            handle=handle, state=state, replica=None, error=message.splitlines()[0], log_dir=log_dir
        )
    failed.sort(key=_failed_at)
    first = failed[0]
    lines = (
        _read_lines(first.stderr) if first.stderr is not None else _log_lines(runner, handle, first)
    )
    recorded = _recorded_error(first.error_file)
    error, cause = recorded or (_last_error_line(lines) or first.exit_text(),) * 2
    end = _line_of(lines, cause)
    tail = (
        tuple(lines[max(0, end - TAIL_LINES) : end + 1])
        if end is not None
        else tuple(lines[-TAIL_LINES:])
    )
    rank = None
    if end is not None and (found := _RANK.match(lines[end])):
        rank = int(found.group(1))
    return Failure(
        handle=handle,
        state=state,
        replica=first,
        error=error,
        rank=rank,
        tail=tail,
        others=tuple(failed[1:]),
        log_dir=log_dir,
    )


def _log_dir(status: Any) -> Path | None:
    url = getattr(status, "ui_url", None) or ""
    parsed = urlparse(url)
    return Path(parsed.path) if parsed.scheme == "file" and parsed.path else None


def _replicas(runner: Any, handle: str, status: Any, log_dir: Path | None) -> list[Replica]:
    """Every replica of the app with its exit code: TorchX's ``SUCCESS`` record where it writes
    one (local schedulers), else the replicas' states in ``status.roles``."""
    record = log_dir / "SUCCESS" if log_dir is not None else None
    if record is not None and record.is_file():
        data = json.loads(record.read_text())
        return [
            Replica(
                role=role,
                index=int(r["replica_id"]),
                exit_code=r.get("exitcode"),
                stdout=_path(r.get("stdout")),
                stderr=_path(r.get("stderr")),
                error_file=_path(r.get("error_file")),
            )
            for role, replicas in data.get("roles", {}).items()
            for r in replicas
        ]
    return [
        Replica(
            role=role_status.role,
            index=int(replica.id),
            exit_code=None,
            state=getattr(replica.state, "name", str(replica.state)),
        )
        for role_status in getattr(status, "roles", None) or []
        for replica in role_status.replicas
    ]


def _path(value: str | None) -> Path | None:
    return Path(value) if value and not value.startswith("<") else None


def _failed_at(replica: Replica) -> tuple[float, bool]:
    """When the replica failed: its error file's time, else its log's last write. File times
    tick coarsely (a few ms): on a tie the replica that recorded its failure comes first, the
    others' last lines being about it (a server aborting because a trainer failed)."""
    for path in (replica.error_file, replica.stderr):
        if path is not None and path.is_file():
            return path.stat().st_mtime, path is not replica.error_file
    return float("inf"), True


def _recorded_error(path: Path | None) -> tuple[str, str] | None:
    """The error in a torchelastic error file (torchrun nests its root cause), as
    :func:`one_line` gives it."""
    if path is None or not path.is_file():
        return None
    try:
        message = json.loads(path.read_text()).get("message")
    except (OSError, ValueError):
        return None
    if isinstance(message, dict):
        message = message.get("message")
    return one_line(str(message or ""))


_TRACEBACK_STARTS = ("Traceback (most recent call last)", "Original Traceback")


def one_line(message: str) -> tuple[str, str] | None:
    """An error message in one line that holds its cause, and that cause's own line (``None``:
    an empty message). An error re-raised for another process carries that process's traceback
    in its message — a DataLoader worker's (``Caught ValueError in DataLoader worker process 1.``,
    ``Original Traceback``), a remote RPC call's (``On WorkerInfo(id=2, name=ps0):``, the remote
    error, its traceback, the C++ frames that passed it on) — whose error line, the first line
    after its frames that is not indented, is the cause; a first line ending in ``:`` goes on in
    the next."""
    lines = [line.rstrip() for line in message.strip().splitlines() if line.strip()]
    if not lines:
        return None
    first = lines[0].strip()
    starts = [i for i, line in enumerate(lines) if i and line.startswith(_TRACEBACK_STARTS)]
    after = lines[starts[-1] + 1 :] if starts else []
    cause = next((line for line in after if not line[0].isspace()), None)
    if cause is not None:
        if first.endswith(":"):
            return f"{first} {cause}", cause
        return f"{cause} ({first.rstrip('.')})", cause
    if first.endswith(":") and len(lines) > 1:
        return f"{first} {lines[1].strip()}", lines[1].strip()
    return first, first


def _read_lines(path: Path | None) -> list[str]:
    if path is None or not path.is_file():
        return []
    return [line.rstrip() for line in path.read_text(errors="replace").splitlines() if line.strip()]


def _log_lines(runner: Any, handle: str, replica: Replica) -> list[str]:
    """The replica's log through the scheduler (``runner.log_lines``), where it keeps one."""
    try:
        return [
            line.rstrip()
            for line in runner.log_lines(handle, replica.role, replica.index)
            if line.strip()
        ]
    except Exception:  # a scheduler without logs: the report says what it can without them
        return []


def _last_error_line(lines: Sequence[str]) -> str | None:
    for line in reversed(lines):
        if _ERROR_LINE.match(line) and not _NOT_A_CAUSE.match(line):
            return _RANK.sub("", line).strip()
    return None


def _line_of(lines: Sequence[str], error: str) -> int | None:
    """The first log line that holds ``error``: the end of the failing process's own traceback,
    before any summary a launcher (torchrun) prints after it."""
    needle = error.strip()[:200]
    return next((index for index, line in enumerate(lines) if needle and needle in line), None)


__all__ = ["Failure", "Replica", "failure", "one_line", "stream"]
