"""Calls that address whole servers rather than rows: their state for checkpoints, request counts.

Each first waits for this trainer's pending fetches and pushes (:func:`distopt.ps.client.flush`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from distopt.errors import ConfigError
from distopt.ps.client import _client, flush
from distopt.ps.futures import rpc_call
from distopt.ps.server import (
    ps_server_load,
    ps_server_load_state_dict,
    ps_server_save,
    ps_server_set_latency,
    ps_server_state_dict,
    ps_server_stats,
)


def state_dict() -> dict[str, dict[str, Any]]:
    """Every server's shards, ``{server: {table: shard_state}}``, after pending pushes complete."""
    client = _client()
    flush()
    futures = {s: rpc_call(s, ps_server_state_dict, (), what="state_dict", timeout_s=client.timeout_s)
               for s in client.servers}
    return {s: f.wait() for s, f in futures.items()}


def load_state_dict(state: Mapping[str, Mapping[str, Any]]) -> None:
    """Restore :func:`state_dict` output (same servers and sharding) on every server."""
    client = _client()
    flush()
    missing = [s for s in client.servers if s not in state]
    if missing:
        raise ConfigError(f"parameter-server checkpoint lacks server {missing[0]!r}")
    futures = [rpc_call(s, ps_server_load_state_dict, (dict(state[s]),), what="load_state_dict",
                        timeout_s=client.timeout_s) for s in client.servers]
    for fut in futures:
        fut.wait()


def save_servers(directory: str) -> dict[str, int]:
    """Each server writes its shards (weights, optimizer state) to ``<directory>/ps<i>.pt``.

    Flushes this trainer's pending pushes first; pushes of other trainers are the caller's to
    drain (the job's checkpoint barrier). Returns ``{file name: size}``. ``directory`` must be on a
    filesystem the servers share with the trainers.
    """
    client = _client()
    flush()
    futures = [rpc_call(s, ps_server_save, (str(directory),), what="checkpoint save",
                        timeout_s=client.timeout_s) for s in client.servers]
    return dict(fut.wait() for fut in futures)


def load_servers(directory: str) -> None:
    """Each server restores its shards from ``<directory>/ps<i>.pt`` (see :func:`save_servers`)."""
    client = _client()
    flush()
    futures = [rpc_call(s, ps_server_load, (str(directory),), what="checkpoint load",
                        timeout_s=client.timeout_s) for s in client.servers]
    for fut in futures:
        fut.wait()


def server_stats(server: str) -> dict[str, int]:
    """Request counts of ``server`` by operation (``fetch``, ``fetch_many``, ``push``, ``requests``)."""
    return rpc_call(server, ps_server_stats, (), what="stats", timeout_s=_client().timeout_s).wait()


def set_latency_ms(latency_ms: float) -> None:
    """Every server answers after ``latency_ms`` from now on (``ServerOptions.latency_ms`` at start)."""
    if latency_ms < 0:
        raise ConfigError(f"latency_ms: expected a number >= 0, got {latency_ms!r}")
    client = _client()
    flush()
    futures = [rpc_call(s, ps_server_set_latency, (float(latency_ms),), what="set latency",
                        timeout_s=client.timeout_s) for s in client.servers]
    for fut in futures:
        fut.wait()
