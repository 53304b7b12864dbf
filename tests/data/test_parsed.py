"""Click logs parsed once and cached next to the file (distopt.data.parsed, CriteoDataset)."""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import distopt.data.criteo as criteo
from distopt.data import DataConfig, build_data
from distopt.data.criteo import CriteoDataset, TableLayout, parse_lines
from distopt.data.generate import write_criteo
from distopt.errors import ConfigError
from distopt.models.dlrm import DLRMConfig

LAYOUT = {"num_tables": 4, "num_rows": 50, "bag_size": 7}


def _age(path: Path, seconds: float = 10.0) -> None:
    """Make ``path`` old enough to be cached (see ``parsed.RACY_S``)."""
    old = time.time_ns() - int(seconds * 1e9)
    os.utime(path, ns=(old, old))


def _caches(directory: Path) -> list[Path]:
    return sorted(directory.glob("*.parsed.npy"))


def _samples(ds: CriteoDataset) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    rows = ds.__getitems__(list(range(len(ds))))
    return rows.dense, rows.ids, rows.labels


def _line_parser(
    path: Path, layout: TableLayout
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Samples as the line parser makes them, one line at a time."""
    dense, ids, labels = [], [], []
    for line in path.read_bytes().splitlines(keepends=True):
        label, values, categorical = parse_lines([line])
        dense.append(torch.from_numpy(values[0]))
        ids.append(torch.from_numpy(layout.ids(categorical[0])))
        labels.append(torch.from_numpy(label))
    return torch.stack(dense), torch.stack(ids), torch.stack(labels)


def _equal(a: tuple[torch.Tensor, ...], b: tuple[torch.Tensor, ...]) -> bool:
    return all(x.dtype == y.dtype and torch.equal(x, y) for x, y in zip(a, b, strict=True))


def test_cached_records_are_the_line_parsers_samples(tmp_path: Path, monkeypatch) -> None:
    path = write_criteo(tmp_path / "clicks.tsv", num_samples=300, seed=1, missing=0.2)
    fresh = CriteoDataset(path, **LAYOUT)  # just written: parsed in memory, not cached
    assert not isinstance(fresh._records, np.memmap) and _caches(tmp_path) == []
    _age(path)
    cached = CriteoDataset(path, **LAYOUT)
    assert isinstance(cached._records, np.memmap) and len(_caches(tmp_path)) == 1
    expected = _line_parser(path, cached.layout)
    assert _equal(_samples(cached), expected) and _equal(_samples(fresh), expected)
    # Shuffled gathers too (what a sampler asks for).
    order = np.random.default_rng(0).permutation(300)[:128].tolist()
    rows = cached.__getitems__(order)
    assert torch.equal(rows.ids, expected[1][order]) and torch.equal(rows.dense, expected[0][order])

    # Opening the unchanged file again reads no line.
    def no_scan(*args, **kwargs):
        raise AssertionError("scanned a cached file")

    monkeypatch.setattr(criteo, "scan", no_scan)
    assert _equal(_samples(CriteoDataset(path, **LAYOUT)), expected)


def test_a_changed_file_gets_new_records(tmp_path: Path) -> None:
    path = write_criteo(tmp_path / "clicks.tsv", num_samples=200, seed=1)
    _age(path, 20.0)
    before = _samples(CriteoDataset(path, **LAYOUT))
    old_cache = _caches(tmp_path)
    # The same size, one label flipped, and the old modification time put back: only the
    # status-change time tells.
    stat = path.stat()
    data = path.read_bytes()
    flipped = (b"0" if data[:1] == b"1" else b"1") + data[1:]
    path.write_bytes(flipped)
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert path.stat().st_size == stat.st_size and path.stat().st_mtime_ns == stat.st_mtime_ns
    after = _samples(CriteoDataset(path, **LAYOUT))
    assert after[2][0].item() == 1.0 - before[2][0].item()
    assert torch.equal(after[2][1:], before[2][1:]) and torch.equal(after[1], before[1])
    new_cache = _caches(tmp_path)
    assert len(new_cache) == 1 and new_cache != old_cache  # the old version is removed

    # Another file of other lines.
    write_criteo(path, num_samples=150, seed=2)
    _age(path)
    ds = CriteoDataset(path, **LAYOUT)
    assert len(ds) == 150 and _equal(_samples(ds), _line_parser(path, ds.layout))


def test_each_layout_has_its_own_records(tmp_path: Path) -> None:
    path = write_criteo(tmp_path / "clicks.tsv", num_samples=100, seed=1)
    _age(path)
    four = CriteoDataset(path, **LAYOUT)
    two = CriteoDataset(path, num_tables=2, num_rows=50)
    other_rows = CriteoDataset(path, num_tables=4, num_rows=60, bag_size=7)
    assert len(_caches(tmp_path)) == 3  # all kept: jobs of several models may share a log
    assert four._records.dtype["ids"].shape == (4, 7) and two._records.dtype["ids"].shape == (2, 13)
    assert _equal(_samples(other_rows), _line_parser(path, other_rows.layout))
    assert not torch.equal(_samples(other_rows)[1], _samples(four)[1])


def test_cache_dir_and_its_fallback(tmp_path: Path, caplog) -> None:
    path = write_criteo(tmp_path / "clicks.tsv", num_samples=100, seed=1)
    _age(path)
    ds = CriteoDataset(path, **LAYOUT, cache_dir=tmp_path / "cache" / "criteo")  # made if missing
    assert len(_caches(tmp_path / "cache" / "criteo")) == 1 and _caches(tmp_path) == []
    expected = _samples(ds)
    blocked = tmp_path / "not-a-directory"
    blocked.write_text("")
    with caplog.at_level(logging.WARNING, logger="distopt.data.parsed"):
        fallback = CriteoDataset(path, **LAYOUT, cache_dir=blocked)
    assert "cannot cache its parsed form" in caplog.text and str(blocked) in caplog.text
    assert not isinstance(fallback._records, np.memmap) and _equal(_samples(fallback), expected)
    assert list(tmp_path.glob("**/*.tmp")) == []


def test_a_malformed_line_still_fails_the_open_and_is_not_cached(tmp_path: Path) -> None:
    path = write_criteo(tmp_path / "clicks.tsv", num_samples=50, seed=1)
    with path.open("a") as f:
        f.write("2" + "\t" * 39 + "\n")
    _age(path)
    with pytest.raises(ConfigError, match=rf"^data.eval_path: {path}:51: field 1 \(label\)"):
        CriteoDataset(path, **LAYOUT, key="data.eval_path")
    assert _caches(tmp_path) == [] and list(tmp_path.glob("*.tmp")) == []


def test_build_data_passes_the_cache_dir(tmp_path: Path) -> None:
    class Model(torch.nn.Module):
        config = DLRMConfig(**LAYOUT)

    path = write_criteo(tmp_path / "clicks.tsv", num_samples=40)
    _age(path)
    cfg = DataConfig(
        source="criteo", path=str(path), holdout_fraction=0.25, cache_dir=str(tmp_path / "cache")
    )
    data = build_data(cfg, model_name="dlrm", model=Model(), batch_size=4, seed=0)
    assert len(_caches(tmp_path / "cache")) == 1 and len(data.train) == 30
