"""Criteo-format click logs (distopt.data.criteo)."""

from __future__ import annotations

import math
import os
import pickle
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from distopt.data.batch import Batch, mix64, mix_ints
from distopt.data.criteo import NUM_CATEGORICAL, CriteoDataset, TableLayout, collate_criteo, scan
from distopt.errors import ConfigError

GOOD = "\t".join(["1", "3", "", "-2", *["0"] * 10, "68fd1e64", "", *["ab"] * 24])


def _write(tmp_path: Path, lines: list[str], name: str = "train.tsv") -> Path:
    path = tmp_path / name
    path.write_text("".join(line + "\n" for line in lines))
    return path


def test_sample_follows_the_dlrm_reference_conventions(tmp_path: Path) -> None:
    ds = CriteoDataset(_write(tmp_path, [GOOD]), num_tables=26, num_rows=100)
    dense, ids, label = ds[0]
    # log(x + 1) with negatives clamped and empty fields read as 0.
    assert dense[:4].tolist() == pytest.approx([math.log(4.0), 0.0, 0.0, 0.0])
    assert dense.dtype == torch.float32 and label.tolist() == [1.0]
    assert ids.shape == (26, 1) and ids.dtype == torch.int64
    # Feature j's id is the stable hash of (j, value) modulo the rows; an empty field is value 0.
    assert int(ids[0, 0]) == int(mix64(np.uint64(0x68FD1E64), 0) % np.uint64(100))
    assert int(ids[1, 0]) == int(mix64(np.uint64(0), 1) % np.uint64(100))
    # Equal values of different features land on unrelated rows.
    assert len(set(ids[2:, 0].tolist())) > 15


def test_hash_is_stable_across_processes() -> None:
    # Fixed expected values: a change of hash function would silently remap trained tables.
    assert mix64(np.array([0, 1, 0x68FD1E64], dtype=np.uint64), 3).tolist() == [
        17909611376780542444,
        8196980753821780235,
        12162687767803035231,
    ]
    assert int(mix64(np.uint64(0), 0)) == 16294208416658607535
    assert mix_ints(7, 1, 12345) == 6268497062324690674


def test_round_robin_layout_pads_short_tables_with_their_last_row() -> None:
    layout = TableLayout(num_tables=4, num_rows=50)
    assert layout.bag_size == 7
    assert layout.table.tolist()[:6] == [0, 1, 2, 3, 0, 1]
    ids = layout.ids(np.arange(NUM_CATEGORICAL, dtype=np.uint64))
    assert ids.shape == (4, 7)
    # Tables 2 and 3 hold 6 features: slot 6 is padding (row 49), hashed ids stay below it.
    assert ids[2, 6] == ids[3, 6] == 49
    assert ids[2, :6].max() < 49 and ids[3, :6].max() < 49
    # Table 0 holds C1, C5, ..., C25 in order.
    expected = mix64(
        np.arange(0, 26, 4, dtype=np.uint64), np.arange(0, 26, 4, dtype=np.uint64)
    ) % np.uint64(50)
    assert ids[0].tolist() == expected.tolist()


def test_explicit_table_mapping_and_bigger_bags() -> None:
    layout = TableLayout(
        num_tables=2, num_rows=10, bag_size=20, table_of_feature=[0] * 20 + [1] * 6
    )
    ids = layout.ids(np.zeros(NUM_CATEGORICAL, dtype=np.uint64))
    assert ids.shape == (2, 20) and (ids[1, 6:] == 9).all()
    assert layout.modulus.tolist() == [10, 9]  # only the padded table reserves its last row


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"num_tables": 4, "num_rows": 10, "bag_size": 4},
            r"^data: 26 categorical features on 4 tables need bag_size >= 7 \(the model's bag_size is 4\)$",
        ),
        ({"num_tables": 27, "num_rows": 10}, r"^data: Criteo data feeds 1 to 26 tables"),
        (
            {"num_tables": 2, "num_rows": 10, "table_of_feature": [0] * 26},
            r"^data.table_of_feature: table 1 gets no feature$",
        ),
        (
            {"num_tables": 2, "num_rows": 10, "table_of_feature": [0, 2] * 13},
            r"^data.table_of_feature: expected 26 table indices in 0..1",
        ),
    ],
)
def test_bad_layout(kwargs: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        TableLayout(**kwargs)


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        (GOOD.rsplit("\t", 1)[0], "expected 40 tab-separated fields, got 39"),
        (GOOD + "\tab", "expected 40 tab-separated fields, got 41"),
        ("2" + GOOD[1:], r"field 1 \(label\): expected 0 or 1, got '2'"),
        (
            GOOD.replace("\t3\t", "\t3.5\t", 1),
            r"field 2 \(I1\): expected an integer or nothing, got '3.5'",
        ),
        (
            GOOD.replace("68fd1e64", "68fd1e6g"),
            r"field 15 \(C1\): expected up to 16 hexadecimal digits",
        ),
        ("", "expected 40 tab-separated fields, got 1"),
    ],
)
def test_malformed_line_names_file_and_line(tmp_path: Path, bad: str, message: str) -> None:
    path = _write(tmp_path, [GOOD, GOOD, bad, GOOD])
    with pytest.raises(ConfigError, match=rf"^data.path: {path}:3: {message}") as info:
        CriteoDataset(path, num_tables=2, num_rows=10)
    assert "\n" not in str(info.value)


def test_missing_and_empty_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"^data.path: file not found: .*nope.tsv$"):
        scan(tmp_path / "nope.tsv")
    with pytest.raises(ConfigError, match=r"^data.eval_path: .*empty.tsv: no samples"):
        scan(_write(tmp_path, [], "empty.tsv"), key="data.eval_path")


def test_crlf_and_missing_final_newline(tmp_path: Path) -> None:
    path = tmp_path / "crlf.tsv"
    path.write_bytes((GOOD + "\r\n" + GOOD).encode())
    ds = CriteoDataset(path, num_tables=1, num_rows=7)
    assert len(ds) == 2 and torch.equal(ds[0][1], ds[1][1])


def test_collate_gives_the_dlrm_layout(tmp_path: Path) -> None:
    lines = [GOOD.replace("\t3\t", f"\t{i}\t", 1) for i in range(5)]
    ds = CriteoDataset(_write(tmp_path, lines), num_tables=4, num_rows=1000)
    batch = collate_criteo([ds[i] for i in range(5)])
    dense, sparse = batch.inputs
    assert dense.shape == (5, 13) and sparse.shape == (4, 5, 7) and batch.targets.shape == (5, 1)
    assert torch.equal(sparse[:, 2], ds[2][1])  # sparse[k] is table k's [B, bag] ids
    assert dense[:, 0].tolist() == pytest.approx([math.log1p(i) for i in range(5)])
    assert ds.collate_fn is collate_criteo


def test_dataset_pickles_cached_records_by_name(tmp_path: Path) -> None:
    path = _write(tmp_path, [GOOD] * 3)
    os.utime(path, ns=(time.time_ns() - 10**10,) * 2)  # old enough to be cached
    ds = CriteoDataset(path, num_tables=2, num_rows=10)
    first = ds[1]
    state = ds.__getstate__()
    assert isinstance(state["_records"], Path) and state["_records"].parent == tmp_path
    copy = pickle.loads(pickle.dumps(ds))
    assert all(torch.equal(a, b) for a, b in zip(copy[1], first, strict=True))
    with pytest.raises(IndexError, match=r"sample 3 of 3$"):
        ds[3]
    with pytest.raises(IndexError, match=r"sample -1 of 3$"):
        ds.__getitems__([0, -1])


@pytest.mark.parametrize("cached", [False, True])
def test_loader_workers_read_the_same_batches(tmp_path: Path, cached: bool) -> None:
    from distopt.data.loader import build_loader

    lines = [GOOD.replace("\t3\t", f"\t{i}\t", 1) for i in range(24)]
    path = _write(tmp_path, lines)
    if cached:  # memory-mapped records, shared with the forked workers
        os.utime(path, ns=(time.time_ns() - 10**10,) * 2)
    ds = CriteoDataset(path, num_tables=4, num_rows=100)

    def batches(workers: int) -> list[Batch]:
        loader = build_loader(
            ds, batch_size=4, num_workers=workers, collate_fn=ds.collate_fn, seed=3
        )
        return list(loader.epoch(0))

    in_process, from_workers = batches(0), batches(2)
    assert len(in_process) == 6
    for a, b in zip(in_process, from_workers, strict=True):
        assert type(b) is Batch  # sent back by value, a plain batch again
        assert all(
            torch.equal(x, y)
            for x, y in zip((*a.inputs, a.targets), (*b.inputs, b.targets), strict=True)
        )
