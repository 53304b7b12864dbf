"""Checkpoint directories: complete only with a matching manifest; the newest complete one wins."""

from __future__ import annotations

import json
from pathlib import Path

from distopt.training.checkpoint import (
    MANIFEST,
    Checkpoint,
    begin,
    check_complete,
    finish,
    latest_complete,
    prune,
    step_dir,
)

JOB = {"num_trainers": 1, "num_ps": 0, "parallel": "none"}


def _write(root: Path, step: int, *, complete: bool = True) -> Path:
    path = begin(root, step)
    (path / "dense").mkdir()
    (path / "dense" / "data.distcp").write_bytes(b"x" * (10 + step))
    (path / "rank0.pt").write_bytes(b"rank")
    if complete:
        finish(path, step=step, job=JOB)
    return path


def test_manifest_lists_every_file_with_its_size(tmp_path: Path) -> None:
    path = _write(tmp_path, 4)
    assert path == step_dir(tmp_path, 4) == tmp_path / "step-00000004"
    manifest = json.loads((path / MANIFEST).read_text())
    assert manifest["step"] == 4 and manifest["job"] == JOB
    assert manifest["files"] == {"dense/data.distcp": 14, "rank0.pt": 4}
    found = check_complete(path)
    assert isinstance(found, Checkpoint) and found.step == 4 and found.job == JOB


def test_incomplete_checkpoints_are_named_and_skipped(tmp_path: Path) -> None:
    _write(tmp_path, 4)
    truncated = _write(tmp_path, 8)
    (truncated / "dense" / "data.distcp").write_bytes(b"short")
    missing = _write(tmp_path, 12)
    (missing / "rank0.pt").unlink()
    _write(tmp_path, 16, complete=False)  # killed before the manifest
    (tmp_path / "step-00000020").mkdir()
    (tmp_path / "step-00000020" / MANIFEST).write_text("{not json")
    skipped: list[tuple[str, str]] = []
    found = latest_complete(tmp_path, on_skip=lambda p, why: skipped.append((p.name, why)))
    assert found is not None and found.step == 4
    assert [name for name, _ in skipped] == [f"step-000000{s:02d}" for s in (20, 16, 12, 8)]
    reasons = dict(skipped)
    assert reasons["step-00000020"].startswith(f"unreadable {MANIFEST}")
    assert reasons["step-00000016"] == f"no {MANIFEST} (interrupted while writing)"
    assert reasons["step-00000012"] == "rank0.pt is missing"
    assert reasons["step-00000008"] == "dense/data.distcp has 5 bytes, the manifest says 18"
    assert latest_complete(tmp_path / "nothing-here") is None


def test_begin_replaces_a_leftover_directory(tmp_path: Path) -> None:
    old = _write(tmp_path, 8, complete=False)
    (old / "stale.pt").write_bytes(b"stale")
    fresh = begin(tmp_path, 8)
    assert fresh == old and list(fresh.iterdir()) == []


def test_prune_keeps_the_newest_complete_checkpoints(tmp_path: Path) -> None:
    for step in (4, 8, 12):
        _write(tmp_path, step)
    _write(tmp_path, 6, complete=False)  # garbage older than the newest complete one
    _write(tmp_path, 16, complete=False)  # may be being written: kept
    deleted = prune(tmp_path, keep=2)
    assert sorted(p.name for p in deleted) == ["step-00000004", "step-00000006"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "step-00000008", "step-00000012", "step-00000016",
    ]  # fmt: skip
    assert prune(tmp_path, keep=0) == []  # 0 keeps everything
