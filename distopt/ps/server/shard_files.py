"""The parameter servers' checkpoint files, and the record naming a job's last complete one.

A checkpoint is a directory holding one file per server, ``ps<i>.pt`` (its shards' weights and
optimizer state), each written atomically by its server: a checkpoint's table data never travels
through a trainer, and a file loads on either backend.

The record (``ps.backend: ray``) is ``<ps.ray_state_dir>/<namespace>.last-checkpoint.json``. A
server actor Ray restarted reads it to know which checkpoint to reload; the trainers rewrite it
once every server has written its file (or loaded it). Why a file, and when it is rewritten:
:mod:`distopt.ps.cluster.ray_recovery`.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

import torch

from distopt.atomic import atomic_torch_save, atomic_write_text
from distopt.errors import ConfigError
from distopt.ps.spec import ServerOptions, server_name


def shard_file(directory: str | Path, index: int) -> Path:
    """The file server ``index`` writes its shards to in checkpoint ``directory``."""
    return Path(directory) / f"{server_name(index)}.pt"


def write_shards(
    directory: str | Path, index: int, num_servers: int, tables: dict[str, dict[str, Any]]
) -> Path:
    """Write server ``index``'s shards (``{table: shard_state}``) atomically; the file."""
    payload = {"server": server_name(index), "num_servers": num_servers, "tables": tables}
    return atomic_torch_save(payload, shard_file(directory, index))


def read_shards(directory: str | Path, index: int, num_servers: int) -> dict[str, dict[str, Any]]:
    """Server ``index``'s shards from checkpoint ``directory``, written by a job of as many servers."""
    name, path = server_name(index), shard_file(directory, index)
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except (OSError, RuntimeError) as err:
        raise ConfigError(f"{name}: cannot load checkpoint {path}: {err}") from None
    if payload.get("num_servers") != num_servers:
        raise ConfigError(
            f"{name}: checkpoint {path} was written by {payload.get('num_servers')} servers, "
            f"this job has {num_servers} (resharding is not supported)"
        )
    return payload["tables"]


def record_path(options: ServerOptions, namespace: str) -> Path:
    """Where the job in Ray ``namespace`` records its last checkpoint."""
    if options.ray_state_dir:
        root = Path(options.ray_state_dir)
    else:
        root = Path(tempfile.gettempdir()) / "distopt-ps-ray"
    return root / f"{namespace}.last-checkpoint.json"


def read_record(path: str | Path) -> str | None:
    """The checkpoint directory the record at ``path`` names; ``None`` when the job saved none."""
    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as err:
        raise ConfigError(f"unreadable checkpoint record {path}: {err}") from None
    directory = data.get("checkpoint") if isinstance(data, dict) else None
    if not isinstance(directory, str):
        raise ConfigError(f"checkpoint record {path} names no checkpoint: {data!r}")
    return directory


def write_record(path: Path, directory: str) -> None:
    """Name ``directory`` the job's last checkpoint, atomically."""
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, json.dumps({"checkpoint": directory}) + "\n")
