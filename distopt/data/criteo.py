"""Criteo-format click logs for the DLRM model: one sample per line of a tab-separated file.

A line holds 40 fields: the label (0 or 1), 13 integer features ``I1..I13`` and 26 categorical
features ``C1..C26`` (hexadecimal strings); any feature may be empty. Following the DLRM reference
(facebookresearch/dlrm ``data_utils.py`` and ``collate_wrapper_criteo_offset``): empty fields read
as 0, negative integers are clamped to 0 and the dense input is ``log(x + 1)``; a categorical value
is its hexadecimal number (empty: 0).

Categorical → table mapping: the model has ``num_tables`` tables (K) of ``num_rows`` rows and
sum-pools ``bag_size`` ids per table and sample. Feature ``C{j+1}`` goes to table
``table_of_feature[j]``, by default ``j % K`` (round robin: with K = 4, table 0 holds C1, C5, ...,
C25 and tables 0-1 get 7 features, tables 2-3 get 6). Its id is a stable hash of (feature, value)
modulo the table's rows, so equal values of different features land on unrelated rows. A table with
fewer features than ``bag_size`` fills its free slots with its last row, which is then reserved for
padding (hashed ids use rows ``0 .. num_rows - 2``): it acts as a learned per-table bias and never
collides with a real value. With K dividing 26 (1, 2, 13, 26) and ``bag_size`` the minimum, there
is no padding.

Why a map-style dataset (not an IterableDataset): a ``DistributedSampler`` then shuffles the whole
file every epoch and gives every trainer the same number of batches (DDP needs equal step counts),
and a resumed run skips to its batch without reading the skipped lines. Opening the file parses it
once (:mod:`distopt.data.parsed`): every line is validated (so a malformed line fails the job
before training, with its file and line number), parsed and hashed into a fixed-size record
(:func:`record_dtype`: 168 bytes with 4 tables of bag 7), and the records are cached next to the
file and memory-mapped. Later opens of the unchanged file (every trainer, every run) skip the
parse, and forked loader workers share the pages. A batch is then a gather of its records:
``__getitems__`` returns :class:`CriteoRows`, which :func:`collate_criteo` batches without
splitting and stacking samples. Measured on 2 busy cores: the first open of 20k lines takes 0.4 s;
a batch of 128 costs a worker 0.1 ms, where reading, parsing and hashing its lines cost 1.9 ms
(which loader workers took from the trainer: benchmark ``data_loading``).
"""

from __future__ import annotations

import hashlib
import itertools
import re
from array import array
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from distopt.data.batch import Batch, mix64
from distopt.data.parsed import load_records
from distopt.errors import ConfigError

NUM_DENSE = 13
NUM_CATEGORICAL = 26
NUM_FIELDS = 1 + NUM_DENSE + NUM_CATEGORICAL
PARSER_VERSION = 1
"""Names how lines become records: bump it when parsing or hashing changes (caches made by another
version are then not used)."""

_INT = rb"(?:-?[0-9]{1,18})?"
_HEX = rb"[0-9a-fA-F]{0,16}"
_LINE = re.compile(
    rb"[01]" + (rb"\t" + _INT) * NUM_DENSE + (rb"\t" + _HEX) * NUM_CATEGORICAL + rb"\r?\n?"
)
_INT_FIELD = re.compile(_INT)
_HEX_FIELD = re.compile(_HEX)


def field_name(index: int) -> str:
    """Criteo's name of field ``index`` (0-based): ``label``, ``I1..I13``, ``C1..C26``."""
    if index == 0:
        return "label"
    return f"I{index}" if index <= NUM_DENSE else f"C{index - NUM_DENSE}"


def _diagnose(line: bytes) -> str:
    """Why ``line`` does not match the format (called only for a line that does not)."""
    fields = line.rstrip(b"\r\n").split(b"\t")
    if len(fields) != NUM_FIELDS:
        return f"expected {NUM_FIELDS} tab-separated fields, got {len(fields)}"
    for index, raw in enumerate(fields):
        text = raw.decode(errors="replace")
        if index == 0 and raw not in (b"0", b"1"):
            return f"field 1 (label): expected 0 or 1, got {text!r}"
        if 1 <= index <= NUM_DENSE and not _INT_FIELD.fullmatch(raw):
            return f"field {index + 1} ({field_name(index)}): expected an integer or nothing, got {text!r}"
        if index > NUM_DENSE and not _HEX_FIELD.fullmatch(raw):
            return (
                f"field {index + 1} ({field_name(index)}): expected up to 16 hexadecimal digits or "
                f"nothing, got {text!r}"
            )
    return "malformed line"


def scan(path: str | Path, *, key: str = "data.path", max_lines: int | None = None) -> np.ndarray:
    """Validate every line of ``path`` (the first ``max_lines``, if given); returns the byte
    offsets of the lines and of the end (``len(lines) + 1`` int64s). A bad line raises
    ``ConfigError("key: path:line: why")``."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{key}: file not found: {path}")
    offsets = array("q", [0])
    position = 0
    with path.open("rb") as f:
        for number, line in enumerate(itertools.islice(f, max_lines), start=1):
            if not _LINE.fullmatch(line):
                raise ConfigError(f"{key}: {path}:{number}: {_diagnose(line)}")
            position += len(line)
            offsets.append(position)
    if len(offsets) == 1:
        raise ConfigError(f"{key}: {path}: no samples (empty file)")
    return np.frombuffer(offsets, dtype=np.int64).copy()


class TableLayout:
    """Where the 26 categorical features go: table, slot within the table's bag, hash modulus."""

    def __init__(
        self,
        *,
        num_tables: int,
        num_rows: int,
        bag_size: int | None = None,
        table_of_feature: Sequence[int] | None = None,
        key: str = "data",
    ) -> None:
        if not 1 <= num_tables <= NUM_CATEGORICAL:
            raise ConfigError(
                f"{key}: Criteo data feeds 1 to {NUM_CATEGORICAL} tables, the model has "
                f"num_tables={num_tables}"
            )
        tables = (
            list(table_of_feature)
            if table_of_feature is not None
            else [j % num_tables for j in range(NUM_CATEGORICAL)]
        )
        if len(tables) != NUM_CATEGORICAL or any(not 0 <= t < num_tables for t in tables):
            raise ConfigError(
                f"{key}.table_of_feature: expected {NUM_CATEGORICAL} table indices in "
                f"0..{num_tables - 1}, got {table_of_feature!r}"
            )
        counts = np.bincount(tables, minlength=num_tables)
        if (counts == 0).any():
            raise ConfigError(
                f"{key}.table_of_feature: table {int(np.argmin(counts))} gets no feature"
            )
        needed = int(counts.max())
        self.bag_size = needed if bag_size is None else bag_size
        if self.bag_size < needed:
            raise ConfigError(
                f"{key}: {NUM_CATEGORICAL} categorical features on {num_tables} tables "
                f"need bag_size >= {needed} (the model's bag_size is {bag_size})"
            )
        padded = counts < self.bag_size
        if padded.any() and num_rows < 2:
            raise ConfigError(f"{key}: padded tables need num_rows >= 2, got {num_rows}")
        self.num_tables, self.num_rows = num_tables, num_rows
        self.table = np.asarray(tables, dtype=np.int64)
        self.slot = np.array([tables[:j].count(t) for j, t in enumerate(tables)], dtype=np.int64)
        self.modulus = np.where(padded, num_rows - 1, num_rows).astype(np.uint64)
        self.padding = np.full((num_tables, self.bag_size), num_rows - 1, dtype=np.int64)

    def ids(self, values: np.ndarray) -> np.ndarray:
        """``[..., K, bag_size]`` row ids of categorical values ``[..., 26]`` (uint64)."""
        salt = np.arange(NUM_CATEGORICAL, dtype=np.uint64)
        hashed = (mix64(values, salt) % self.modulus[self.table]).astype(np.int64)
        ids = np.broadcast_to(self.padding, (*values.shape[:-1], *self.padding.shape)).copy()
        ids[..., self.table, self.slot] = hashed
        return ids

    @property
    def tag(self) -> str:
        """Names the records this layout makes of a line (cached parsed forms are keyed by it)."""
        key = (
            PARSER_VERSION,
            self.num_rows,
            self.bag_size,
            self.table.tolist(),
            record_dtype(self).descr,
        )
        return hashlib.sha256(repr(key).encode()).hexdigest()[:12]


def record_dtype(layout: TableLayout) -> np.dtype:
    """One parsed line: ``label`` float32, ``dense [13]`` float32 (``log(x + 1)``), ``ids [K,
    bag_size]`` (int32 when every row number fits, else int64; batches hold int64)."""
    ids = np.int32 if layout.num_rows <= 1 << 31 else np.int64
    return np.dtype(
        [
            ("label", np.float32),
            ("dense", np.float32, (NUM_DENSE,)),
            ("ids", ids, (layout.num_tables, layout.bag_size)),
        ]
    )


def _zero_filled(line: bytes) -> bytes:
    """``line`` without its end of line, every empty field written as ``0``."""
    line = line.rstrip(b"\r\n").replace(b"\t\t", b"\t0\t").replace(b"\t\t", b"\t0\t")
    return line + b"0" if line.endswith(b"\t") else line


_HEX_DIGITS = 16
_PARSE_CHUNK = 16384  # lines parsed at once when a file is opened (about 15 MB of temporaries)


def _hex_values(fields: np.ndarray) -> np.ndarray:
    """uint64 values of a byte-string array of hexadecimal numbers (up to 16 digits each)."""
    codes = np.frombuffer(fields.astype(f"S{_HEX_DIGITS}").tobytes(), dtype=np.uint8)
    codes = codes.reshape(*fields.shape, _HEX_DIGITS)
    # '0'-'9' are 48-57; 'a'-'f' (and 'A'-'F' made lower case by | 32) are 97-102.
    digits = np.where(codes <= 57, codes - 48, (codes | 32) - 87).astype(np.uint64)
    valid = codes != 0  # left-aligned, NUL-padded
    length = valid.sum(axis=-1, keepdims=True)
    shift = np.clip((length - 1 - np.arange(_HEX_DIGITS)) * 4, 0, None).astype(np.uint64)
    # Digits occupy disjoint bits, so their sum is the number.
    return np.where(valid, digits << shift, np.uint64(0)).sum(axis=-1, dtype=np.uint64)


def parse_lines(lines: Sequence[bytes]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(labels [N] float32, dense [N, 13] float32 = log(max(x, 0) + 1), categorical [N, 26]
    uint64)`` of valid lines (empty fields read as 0, as in the DLRM reference).

    Vectorized: the lines are split once and numpy parses the fields, hexadecimal ones included.
    Lines must have passed :func:`scan`.
    """
    # S20 holds any valid field (a sign and 18 digits, or 16 hex digits); naming the type spares
    # numpy a pass to find the longest.
    fields = np.array(b"\t".join(_zero_filled(line) for line in lines).split(b"\t"), dtype="S20")
    fields = fields.reshape(len(lines), NUM_FIELDS)
    labels = (fields[:, 0] == b"1").astype(np.float32)
    dense = fields[:, 1 : 1 + NUM_DENSE].astype(np.int64).astype(np.float64)
    categorical = _hex_values(fields[:, 1 + NUM_DENSE :])
    return labels, np.log1p(np.maximum(dense, 0.0)).astype(np.float32), categorical


def parse_records(lines: Sequence[bytes], layout: TableLayout) -> np.ndarray:
    """Records (:func:`record_dtype`) of valid lines: :func:`parse_lines` hashed by ``layout``."""
    labels, dense, categorical = parse_lines(lines)
    records = np.empty(len(lines), dtype=record_dtype(layout))
    records["label"], records["dense"], records["ids"] = labels, dense, layout.ids(categorical)
    return records


def line_chunks(path: Path, offsets: np.ndarray) -> Iterator[list[bytes]]:
    """The lines of ``path`` that :func:`scan` found at ``offsets``, a few thousand at a time."""
    count = len(offsets) - 1
    with path.open("rb") as f:
        for start in range(0, count, _PARSE_CHUNK):
            stop = min(start + _PARSE_CHUNK, count)
            data = f.read(int(offsets[stop] - offsets[start]))
            ends = (offsets[start : stop + 1] - offsets[start]).tolist()
            yield [data[a:b] for a, b in itertools.pairwise(ends)]


class CriteoRows(Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]):
    """Samples parsed together (what :meth:`CriteoDataset.__getitems__` returns): indexable as
    samples, and batched by :func:`collate_criteo` without splitting and stacking them again."""

    def __init__(self, dense: torch.Tensor, ids: torch.Tensor, labels: torch.Tensor) -> None:
        self.dense, self.ids, self.labels = dense, ids, labels

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            return CriteoRows(self.dense[index], self.ids[index], self.labels[index])
        return self.dense[index], self.ids[index], self.labels[index]


def collate_criteo(samples: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> Batch:
    """``Batch(inputs=(dense [B, 13], sparse [K, B, bag_size]), targets=labels [B, 1])``: the
    layout ``DLRM.forward(dense, sparse)`` reads (``sparse[k]`` are table k's ids)."""
    if isinstance(samples, CriteoRows):  # parsed as a batch already: only the ids' layout changes
        return Batch((samples.dense, samples.ids.transpose(0, 1).contiguous()), samples.labels)
    dense = torch.stack([s[0] for s in samples])
    sparse = torch.stack([s[1] for s in samples], dim=1)
    labels = torch.stack([s[2] for s in samples])
    return Batch((dense, sparse), labels)


class CriteoDataset(Dataset[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]):
    """Samples ``(dense [13] float32, ids [K, bag_size] int64, label [1] float32)`` of a
    Criteo-format file; batch them with :func:`collate_criteo` (the ``collate_fn`` attribute)."""

    def __init__(
        self,
        path: str | Path,
        *,
        num_tables: int,
        num_rows: int,
        bag_size: int | None = None,
        table_of_feature: Sequence[int] | None = None,
        key: str = "data.path",
        cache_dir: str | Path | None = None,
    ) -> None:
        """Errors about the file start with ``key`` (the config key that named it), errors about
        the table layout with ``data``. ``cache_dir``: where the parsed form is cached (default:
        next to the file)."""
        self.path = Path(path)
        self.layout = TableLayout(
            num_tables=num_tables,
            num_rows=num_rows,
            bag_size=bag_size,
            table_of_feature=table_of_feature,
        )
        if not self.path.is_file():
            raise ConfigError(f"{key}: file not found: {self.path}")
        self._records = load_records(
            self.path,
            tag=self.layout.tag,
            dtype=record_dtype(self.layout),
            parse=lambda: self._parse(key),
            cache_dir=cache_dir,
        )

    collate_fn = staticmethod(collate_criteo)

    def _parse(self, key: str) -> tuple[int, Iterator[np.ndarray]]:
        offsets = scan(self.path, key=key)  # validates every line before any is parsed
        return len(offsets) - 1, self._parsed_chunks(offsets)

    def _parsed_chunks(self, offsets: np.ndarray) -> Iterator[np.ndarray]:
        for lines in line_chunks(self.path, offsets):
            yield parse_records(lines, self.layout)

    def __len__(self) -> int:
        return len(self._records)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.__getitems__([index])[0]

    def __getitems__(self, indices: Sequence[int]) -> CriteoRows:
        """Samples ``indices``, gathered together (the DataLoader fetches a batch so)."""
        size = len(self)
        rows = np.asarray(indices, dtype=np.int64)
        outside = (rows < 0) | (rows >= size)
        if outside.any():
            raise IndexError(f"{self.path}: sample {indices[int(np.argmax(outside))]} of {size}")
        records = self._records[rows]  # a copy, also from a memory map
        return CriteoRows(
            torch.from_numpy(np.ascontiguousarray(records["dense"])),
            torch.from_numpy(records["ids"].astype(np.int64)),
            torch.from_numpy(np.ascontiguousarray(records["label"])).unsqueeze(1),
        )

    def __getstate__(self) -> dict[str, Any]:
        # Cached records travel as their file's name (a spawned process maps them again), not as
        # a copy of the whole file's records.
        state = dict(self.__dict__)
        if isinstance(self._records, np.memmap) and self._records.filename is not None:
            state["_records"] = Path(self._records.filename)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        if isinstance(self._records, Path):
            self._records = np.load(self._records, mmap_mode="r")


__all__ = [
    "CriteoDataset",
    "CriteoRows",
    "TableLayout",
    "collate_criteo",
    "field_name",
    "line_chunks",
    "parse_lines",
    "parse_records",
    "record_dtype",
    "scan",
]
