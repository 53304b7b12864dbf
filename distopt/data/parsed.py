"""The parsed form of a text data file: parsed once, kept next to the file, memory-mapped.

Why: a loader worker that parses its batch's lines competes for the cores with the trainer it
feeds. Measured on 2 shared cores (DLRM, batch 128, one parameter-server process, 2 workers):
reading, parsing and hashing a Criteo batch cost the workers 1.9 ms of CPU per step of about
25 ms. Parsed once into fixed-size records, a batch is a gather of ``B`` records (about 0.1 ms),
and every process of a host (its trainers and their forked loader workers) shares the pages.

:func:`load_records` returns the records of ``source`` as a read-only memory map of
``{cache_dir}/{source name}.{tag}-{version}.parsed.npy`` (``cache_dir`` defaults to the source's
directory). ``tag`` names what the records depend on besides the file's bytes (for Criteo: the
table layout and the parser's version); ``version`` names the file: its size, modification and
status-change times (ns) and inode, so a rewritten, touched or replaced file gets new records. A
missing cache is built: ``parse()`` validates the whole source (raising its errors, so a bad file
still fails the job before training) and yields the records in chunks, which go to a temporary
file renamed into place; an advisory lock on the source makes the trainers of a host that open
it at once wait for one parse. A build removes the tag's older versions.

The records are kept in memory instead (every opening process parses) when the cache cannot be
written (a warning names the directory), and when the source was modified less than ``RACY_S``
seconds before the parse began: a rewrite of the same size within the file system's timestamp
granularity would keep its modification time, and a cache of it would then serve the old lines
(git's "racily clean" files).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import BinaryIO

import numpy as np

logger = logging.getLogger(__name__)

RACY_S = 2.0
"""A source modified less than this long before its parse is not cached (see the module docstring);
well above Linux file systems' timestamp granularity (a clock tick, at most 10 ms)."""
SUFFIX = ".parsed.npy"

Parse = Callable[[], tuple[int, Iterable[np.ndarray]]]
"""Validates the source, then returns ``(number of records, chunks of records in order)``."""


def cache_path(source: Path, tag: str, stat: os.stat_result, cache_dir: str | Path | None) -> Path:
    """Where the records of ``source`` (as ``stat`` describes it) under ``tag`` are cached."""
    version = f"{stat.st_size}:{stat.st_mtime_ns}:{stat.st_ctime_ns}:{stat.st_ino}"
    digest = hashlib.sha256(version.encode()).hexdigest()[:16]
    return Path(cache_dir or source.parent) / f"{source.name}.{tag}-{digest}{SUFFIX}"


def _mapped(path: Path, dtype: np.dtype) -> np.ndarray | None:
    """The records cached at ``path``; ``None`` when there are none (or they are not readable)."""
    try:
        records = np.load(path, mmap_mode="r")
    except (FileNotFoundError, NotADirectoryError):
        return None
    except (OSError, ValueError) as err:
        logger.warning("%s: unreadable cached records (%s); parsing again", path, err)
        return None
    return records if records.dtype == dtype and records.ndim == 1 else None


def _collect(count: int, chunks: Iterable[np.ndarray], dtype: np.dtype) -> np.ndarray:
    records = np.empty(count, dtype=dtype)
    filled = 0
    for chunk in chunks:
        records[filled : filled + len(chunk)] = chunk
        filled += len(chunk)
    if filled != count:
        raise RuntimeError(f"parsed {filled} records, expected {count}")
    return records


def _write(out: BinaryIO, count: int, chunks: Iterable[np.ndarray], dtype: np.dtype) -> None:
    header = {
        "descr": np.lib.format.dtype_to_descr(dtype),
        "fortran_order": False,
        "shape": (count,),
    }
    np.lib.format.write_array_header_1_0(out, header)
    written = 0
    for chunk in chunks:
        out.write(np.ascontiguousarray(chunk, dtype=dtype).tobytes())
        written += len(chunk)
    if written != count:
        raise RuntimeError(f"parsed {written} records, expected {count}")


def _remove_older(target: Path, prefix: str) -> None:
    """Other versions of ``target`` (the same source and tag): the source has changed since."""
    with contextlib.suppress(OSError):
        for path in target.parent.iterdir():
            if path != target and path.name.startswith(prefix) and path.name.endswith(SUFFIX):
                path.unlink(missing_ok=True)


def load_records(
    source: str | Path,
    *,
    tag: str,
    dtype: np.dtype,
    parse: Parse,
    cache_dir: str | Path | None = None,
) -> np.ndarray:
    """The records of ``source``: memory-mapped from its cache, which is built first when missing;
    in memory when it cannot be cached (see the module docstring)."""
    source = Path(source)
    with source.open("rb") as lock:
        with contextlib.suppress(OSError):  # no advisory locks (some network file systems): race
            fcntl.flock(lock.fileno(), fcntl.LOCK_EX)  # released when the file closes
        stat = os.fstat(lock.fileno())
        target = cache_path(source, tag, stat, cache_dir)
        cached = _mapped(target, dtype)
        if cached is not None:
            return cached
        if time.time_ns() - stat.st_mtime_ns < RACY_S * 1e9:
            return _collect(*parse(), dtype)
        temporary = target.with_name(f"{target.name}.{os.getpid()}.tmp")
        try:
            try:
                target.parent.mkdir(parents=True, exist_ok=True)
                with temporary.open("wb") as out:
                    _write(out, *parse(), dtype)
                os.replace(temporary, target)
            except OSError as err:  # a read-only directory, a full disk
                logger.warning(
                    "%s: cannot cache its parsed form in %s (%s); parsing it in memory "
                    "(data.cache_dir can name another directory)",
                    source,
                    target.parent,
                    err,
                )
                return _collect(*parse(), dtype)  # again: the write may have consumed some chunks
        finally:
            with contextlib.suppress(OSError):
                temporary.unlink(missing_ok=True)
        _remove_older(target, f"{source.name}.{tag}-")
        mapped = _mapped(target, dtype)
        if mapped is None:
            raise RuntimeError(f"{target}: the records just written do not read back")
        return mapped


__all__ = ["RACY_S", "cache_path", "load_records"]
