"""Writing files so that a reader (or a restarted job) never sees half of one.

Each write goes to a temporary file in the target's directory, is fsynced, then renamed over the
target (``os.replace`` is atomic on POSIX filesystems); the directory is fsynced so the rename
itself survives a power loss.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import torch


def fsync_dir(directory: str | Path) -> None:
    """Persist the entries of ``directory`` (renames, new files); a no-op where unsupported."""
    with contextlib.suppress(OSError):
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def atomic_write(path: str | Path, write: Callable[[IO[bytes]], Any]) -> Path:
    """Call ``write(stream)`` on a temporary file, fsync it, rename it to ``path``."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as stream:
            write(stream)
            stream.flush()
            os.fsync(stream.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)
    return path


def atomic_torch_save(obj: Any, path: str | Path) -> Path:
    """``torch.save(obj, path)``, atomically."""
    return atomic_write(path, lambda stream: torch.save(obj, stream))


def atomic_write_text(path: str | Path, text: str) -> Path:
    """Write ``text`` (UTF-8) to ``path``, atomically."""
    return atomic_write(path, lambda stream: stream.write(text.encode()))
