"""Calls that address whole servers rather than rows: their state for checkpoints, request counts,
the injected latency.

Each first waits for this trainer's pending fetches and pushes (:func:`distopt.ps.flush`), then
asks every server of the job at once over the job's transport.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from distopt.errors import ConfigError
from distopt.ps.client.calls import current
from distopt.ps.cluster.session import session


def _on_every_server(
    op: str, what: str, args: Callable[[str], tuple[Any, ...]] = lambda _: ()
) -> dict[str, Any]:
    """Operation ``op(*args(server))`` on every server of the job, concurrently, once this
    trainer's pending fetches and pushes are done; the answers by server."""
    client = current()
    client.flush()
    futures = {
        server: client.call(server, op, args(server), what=what, timeout_s=client.timeout_s)
        for server in client.servers
    }
    return {server: future.wait() for server, future in futures.items()}


def state_dict() -> dict[str, dict[str, Any]]:
    """Every server's shards, ``{server: {table: shard_state}}``, after pending pushes complete."""
    return _on_every_server("state_dict", "state_dict")


def load_state_dict(state: Mapping[str, Mapping[str, Any]]) -> None:
    """Restore :func:`state_dict` output (same servers and sharding) on every server."""
    missing = [server for server in current().servers if server not in state]
    if missing:
        raise ConfigError(f"parameter-server checkpoint lacks server {missing[0]!r}")
    _on_every_server("load_state_dict", "load_state_dict", lambda server: (dict(state[server]),))


def save_servers(directory: str) -> dict[str, int]:
    """Each server writes its shards (weights, optimizer state) to ``<directory>/ps<i>.pt``.

    Flushes this trainer's pending pushes first; pushes of other trainers are the caller's to
    drain (the job's checkpoint barrier). Returns ``{file name: size}``. ``directory`` must be on
    a filesystem the servers share with the trainers. On the Ray backend the directory becomes the
    job's last checkpoint once every server has written its file: a restarted actor reloads it
    (:mod:`distopt.ps.cluster.ray_recovery`).
    """
    with session().recording(str(directory)):
        saved = _on_every_server("save", "checkpoint save", lambda _: (str(directory),))
    return dict(saved.values())


def load_servers(directory: str) -> None:
    """Each server restores its shards from ``<directory>/ps<i>.pt`` (see :func:`save_servers`);
    on the Ray backend the directory becomes the job's last checkpoint."""
    with session().recording(str(directory)):
        _on_every_server("load", "checkpoint load", lambda _: (str(directory),))


def server_stats(server: str) -> dict[str, int]:
    """Request counts of ``server`` by operation (``fetch``, ``fetch_many``, ``push``,
    ``push_many``, ``requests``) and its PID."""
    client = current()
    return client.call(server, "stats", (), what="stats", timeout_s=client.timeout_s).wait()


def set_latency_ms(latency_ms: float) -> None:
    """Every server answers after ``latency_ms`` from now on (``ServerOptions.latency_ms`` at start)."""
    if latency_ms < 0:
        raise ConfigError(f"latency_ms: expected a number >= 0, got {latency_ms!r}")
    _on_every_server("set_latency", "set latency", lambda _: (float(latency_ms),))
