"""Checkpoint directories: one per step, complete only once its manifest is written.

Layout of ``<checkpoint_dir>/step-00000040/`` (the state after 40 steps)::

    dense/          model + optimizer (torch.distributed.checkpoint); written collectively by the
                    trainers when the dense parameters are replicated (DDP) or sharded (FSDP)
    dense-rank<r>/  instead of dense/ when each trainer trains its own dense model
    rank<r>.pt      trainer r: completed steps and RNG states (see :mod:`distopt.training.state`)
    ps<i>.pt        parameter server i: its shards of every table with their optimizer state
    MANIFEST.json   written LAST, atomically, by trainer 0: the step, the job's shape, and the
                    name and size of every other file

A directory without a readable manifest, or whose files do not match it (missing, other size), is
incomplete: a job killed while writing a checkpoint leaves one, and :func:`latest_complete` skips
it, so a restarted job resumes from the newest checkpoint that was fully written.
"""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from distopt.atomic import atomic_write_text, fsync_dir

MANIFEST = "MANIFEST.json"
FORMAT = 1
_NAME = re.compile(r"^step-(\d{8,})$")


@dataclasses.dataclass(kw_only=True, slots=True, frozen=True)
class Checkpoint:
    """A complete checkpoint directory."""

    path: Path
    step: int
    """Completed training steps when it was cut."""
    manifest: Mapping[str, Any]
    """The parsed ``MANIFEST.json`` (``step``, ``job``, ``files``)."""

    @property
    def job(self) -> Mapping[str, Any]:
        """The shape of the job that wrote it (trainers, servers, parallelism, run id)."""
        return self.manifest.get("job", {})


def step_dir(root: str | Path, step: int) -> Path:
    """Directory of the checkpoint after ``step`` steps."""
    return Path(root) / f"step-{step:08d}"


def _files(path: Path) -> dict[str, int]:
    """``{relative path: size}`` of every file under ``path`` except the manifest and temporaries."""
    return {
        str(f.relative_to(path)): f.stat().st_size
        for f in sorted(path.rglob("*"))
        if f.is_file() and f.name != MANIFEST and not f.name.endswith(".tmp")
    }


def check_complete(path: str | Path) -> Checkpoint | str:
    """The checkpoint at ``path``, or why it is incomplete (one line)."""
    path = Path(path)
    match = _NAME.match(path.name)
    if match is None:
        return f"{path.name} is not a step-<N> directory"
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except FileNotFoundError:
        return f"no {MANIFEST} (interrupted while writing)"
    except (OSError, ValueError) as err:
        return f"unreadable {MANIFEST}: {err}"
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        return f"{MANIFEST} is not format {FORMAT}"
    if manifest.get("step") != int(match.group(1)):
        return f"{MANIFEST} says step {manifest.get('step')!r}"
    files = manifest.get("files")
    if not isinstance(files, dict) or not files:
        return f"{MANIFEST} lists no files"
    for name, size in files.items():
        file = path / name
        if not file.is_file():
            return f"{name} is missing"
        if file.stat().st_size != size:
            return f"{name} has {file.stat().st_size} bytes, the manifest says {size}"
    return Checkpoint(path=path, step=manifest["step"], manifest=manifest)


def latest_complete(
    root: str | Path, *, on_skip: Callable[[Path, str], None] | None = None
) -> Checkpoint | None:
    """The complete checkpoint with the highest step under ``root``, or None.

    ``on_skip(path, reason)`` is called for every newer directory skipped as incomplete.
    """
    root = Path(root)
    if not root.is_dir():
        return None
    candidates = sorted(
        ((int(m.group(1)), p) for p in root.iterdir() if p.is_dir() and (m := _NAME.match(p.name))),
        reverse=True,
    )
    for _, path in candidates:
        found = check_complete(path)
        if isinstance(found, Checkpoint):
            return found
        if on_skip is not None:
            on_skip(path, found)
    return None


def begin(root: str | Path, step: int) -> Path:
    """Make an empty directory for the checkpoint after ``step`` steps (trainer 0, before the others
    write). A directory already there is a leftover of an interrupted attempt: its manifest goes
    first, so it can never look complete while it is being replaced."""
    path = step_dir(root, step)
    if path.exists():
        (path / MANIFEST).unlink(missing_ok=True)
        shutil.rmtree(path)
    path.mkdir(parents=True)
    fsync_dir(path.parent)
    return path


def finish(path: Path, *, step: int, job: Mapping[str, Any]) -> Checkpoint:
    """Write the manifest of ``path`` (every file must already be written and synced): from now on
    the checkpoint is complete."""
    files = _files(path)
    manifest = {"format": FORMAT, "step": step, "job": dict(job), "files": files}
    atomic_write_text(path / MANIFEST, json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    return Checkpoint(path=path, step=step, manifest=manifest)


def prune(root: str | Path, *, keep: int) -> list[Path]:
    """Keep the ``keep`` newest complete checkpoints; delete older ones and incomplete directories
    older than the newest complete one. Returns what was deleted."""
    root = Path(root)
    if keep < 1 or not root.is_dir():
        return []
    steps = sorted(
        ((int(m.group(1)), p) for p in root.iterdir() if p.is_dir() and (m := _NAME.match(p.name))),
        reverse=True,
    )
    complete = [p for _, p in steps if isinstance(check_complete(p), Checkpoint)]
    if not complete:
        return []
    newest = int(_NAME.match(complete[0].name).group(1))  # type: ignore[union-attr]
    doomed = [p for p in complete[keep:]]
    doomed += [p for s, p in steps if s < newest and p not in complete]
    for path in doomed:
        (path / MANIFEST).unlink(missing_ok=True)  # incomplete first, then gone
        shutil.rmtree(path, ignore_errors=True)
    return doomed
