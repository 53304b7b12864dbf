"""Going on after Ray restarted a parameter-server actor (``ps.backend: ray``, ``ps.max_restarts``).

When a server actor's process dies, the calls in flight on it fail at the trainer's wait with a
one-line :class:`~distopt.errors.RemoteCallError` naming the table and the actor. With
``max_restarts > 0`` Ray then runs the actor's constructor again in a new process. That actor:

1. reloads its shards from the job's **last checkpoint**: the directory named by the job's record
   file (below), or keeps the seeded initial tables when the job never saved one, and says which in
   a log line (its Ray worker log, and the trainer's log when it recovers);
2. refuses fetches, pushes and saves (``ServerRestarted``) until a trainer calls :func:`recover`.
   Its shards now hold the checkpoint, the other servers hold later steps, and the trainer's dense
   model holds later steps still: answering would train on a mix. Refusing also makes a restart
   that happened while nothing was in flight visible at the next call.

:func:`recover` waits for this trainer's calls to be answered (none can land later), for every
actor to answer again, reloads **every** server from the same checkpoint, and clears the client's
per-table order (a failed push marks its table unknown until then). The training loop rolls its
dense model, optimizer and data position back to the same checkpoint::

    try:
        step_once(step)
    except distopt.RemoteCallError:
        restored = distopt.ps.recover()          # every server back at the last checkpoint
        step = load_dense(restored.checkpoint)   # the loop's own checkpoint of the same step
        continue

A checkpoint is the loop's dense state written first, then :func:`~distopt.ps.save_servers` into
the same directory: the record (below) then only names checkpoints whose dense state exists.

With ``max_restarts: 0`` a dead actor stays dead: every later call fails and :func:`recover` raises.

**The record.** An actor's constructor arguments are fixed when the job creates it, so the
restarted actor learns which checkpoint is the last one from a file:
``<ServerOptions.ray_state_dir>/<namespace>.last-checkpoint.json``, whose path is an argument. The
trainer rewrites it, atomically (:mod:`distopt.atomic`), when :func:`~distopt.ps.save_servers` has
heard every server's file written, or :func:`~distopt.ps.load_servers` every server's load done.
Before a save into the directory the record names, the record is removed. So the record only
ever names a directory holding one complete file per server, all from the same save: a checkpoint
being written when an actor dies is never loaded, half or whole. A file rather than a small
registry actor: it survives any process of the job dying (a registry actor would lose the record
in a restart of its own; Ray's internal key-value store is a private API), and the checkpoint
files it points to need the same shared filesystem anyway.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from distopt.atomic import atomic_write_text
from distopt.errors import ConfigError, RemoteCallError
from distopt.ps import client as ps_client
from distopt.ps import context
from distopt.ps.ordering import TableOrder
from distopt.ps.spec import ServerOptions

logger = logging.getLogger(__name__)


def record_path(options: ServerOptions, namespace: str) -> Path:
    """Where the job in Ray ``namespace`` records its last checkpoint."""
    root = Path(options.ray_state_dir) if options.ray_state_dir else Path(tempfile.gettempdir()) / "distopt-ps-ray"
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


def _joined() -> tuple[Any, Any] | None:
    """``(job, transport)`` of the Ray job this process joined as a trainer, else ``None``."""
    from distopt.ps import launch

    membership = launch._JOINED[-1] if launch._JOINED else None
    if membership is None or membership.transport is None:
        return None
    return membership.job, membership.transport


@contextlib.contextmanager
def recording(directory: str) -> Iterator[None]:
    """Around a save into or a load from ``directory`` by every server: on success, record it as
    the job's last checkpoint (a no-op outside a Ray job)."""
    joined = _joined()
    if joined is None:
        yield
        return
    job, _ = joined
    path = record_path(job.options, job.ray_namespace)
    directory = os.path.abspath(directory)
    if read_record(path) == directory:
        path.unlink(missing_ok=True)  # its files are about to be rewritten one by one
    yield
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, json.dumps({"checkpoint": directory}) + "\n")


@dataclasses.dataclass(frozen=True, slots=True)
class Recovery:
    """What :func:`recover` did."""

    checkpoint: str | None
    """The checkpoint every server now holds; ``None``: the seeded initial tables (step 0)."""
    restarted: tuple[str, ...]
    """Servers Ray had restarted since they last recovered (``ps1``, ...)."""


def _ray_job(what: str) -> tuple[Any, Any]:
    joined = _joined()
    if joined is None:
        raise RemoteCallError(f"distopt.ps.{what}: only a ps.backend=ray job's servers come back after a "
                              "failure (RPC jobs restart whole: distopt.supervise, docs/reliability.md)")  # fmt: skip
    return joined


def _answers(transport: Any, method: str, args: tuple[Any, ...], timeout_s: float) -> dict[str, Any]:
    """``method(*args)`` on every actor: its answer, or the exception, by server; ``None`` for no
    answer within ``timeout_s``."""
    import ray

    refs = {name: getattr(handle, method).remote(*args) for name, handle in transport.handles.items()}
    ready, _ = ray.wait(list(refs.values()), num_returns=len(refs), timeout=timeout_s)
    out: dict[str, Any] = {}
    for name, ref in refs.items():
        if ref not in ready:
            out[name] = None
            continue
        try:
            out[name] = ray.get(ref)
        except Exception as err:
            out[name] = err
    return out


def _poll(transport: Any, timeout_s: float, *, give_up: bool) -> dict[str, Any]:
    """Every actor's ``incarnation()`` answer, asked again until all answer or ``timeout_s`` has
    passed (a dead actor fails calls until Ray has restarted it); with ``give_up``, after the first
    round. Missing answers are the exception (``None``: no answer in time)."""
    deadline = time.monotonic() + timeout_s
    while True:
        answers = _answers(transport, "incarnation", (), max(0.1, deadline - time.monotonic()))
        if give_up or time.monotonic() >= deadline or all(isinstance(a, dict) for a in answers.values()):
            return answers
        time.sleep(0.2)


def servers_ready(timeout_s: float = 5.0) -> bool:
    """Whether every server actor of this trainer's Ray job answers within ``timeout_s`` (a
    restarted one once its constructor has reloaded the checkpoint)."""
    job, transport = _ray_job("servers_ready")
    answers = _poll(transport, timeout_s, give_up=job.options.max_restarts == 0)
    return all(isinstance(a, dict) for a in answers.values())


def _wait_for_servers(transport: Any, options: ServerOptions) -> dict[str, dict[str, Any]]:
    """Every actor's ``incarnation()``, once each answers; a one-line error naming the first that
    does not within ``options.start_timeout_s`` (at once with ``max_restarts: 0``)."""
    from distopt.ps.ray_transport import ray_message

    answers = _poll(transport, options.start_timeout_s, give_up=options.max_restarts == 0)
    missing = {name: a for name, a in answers.items() if not isinstance(a, dict)}
    if not missing:
        return answers
    name, answer = sorted(missing.items())[0]
    why = "no answer" if answer is None else ray_message(answer)
    if options.max_restarts == 0:
        raise RemoteCallError(f"distopt.ps.recover: {name} is gone and Ray does not restart it "
                              f"(ps.max_restarts=0): {why}")  # fmt: skip
    raise RemoteCallError(
        f"distopt.ps.recover: {name} did not come back within {options.start_timeout_s:g} s "
        f"(ps.start_timeout_s; Ray restarts it at most ps.max_restarts={options.max_restarts} times): {why}")  # fmt: skip


def recover(directory: str | None = None) -> Recovery:
    """Bring every server of this trainer's ``ps.backend: ray`` job back to one checkpoint.

    ``directory``: the checkpoint to reload (a :func:`~distopt.ps.save_servers` directory); by
    default the job's last one (see the module), the seeded initial tables if it saved none.
    Waits for this trainer's calls to be answered, then for every actor (a restarted one within
    ``ps.start_timeout_s``), reloads every server and clears this trainer's per-table order and
    the step's fetched rows. Raises :class:`RemoteCallError` naming a server that does not come
    back. Several trainers: all stop, call ``recover`` after a barrier (it is idempotent), and
    start again after another barrier.
    """
    from distopt.ps.ray_transport import ray_message

    job, transport = _ray_job("recover")
    options: ServerOptions = job.options
    ps_client.flush()
    unanswered = transport.quiesce(options.rpc_timeout_s)
    if unanswered:
        raise RemoteCallError(f"distopt.ps.recover: {unanswered} calls still unanswered after "
                              f"{options.rpc_timeout_s:g} s (ps.rpc_timeout_s): a server is stuck")  # fmt: skip
    before = _wait_for_servers(transport, options)
    restarted = tuple(sorted(name for name, info in before.items() if info["fenced"]))
    for name in restarted:
        logger.warning("distopt.ps: %s", before[name]["note"])
    if directory is None:
        directory = read_record(record_path(options, job.ray_namespace))
    else:
        directory = os.path.abspath(directory)
    for name, answer in sorted(_answers(transport, "restore", (directory,), options.rpc_timeout_s).items()):
        if not isinstance(answer, str):
            why = "no answer" if answer is None else ray_message(answer)
            raise RemoteCallError(f"distopt.ps.recover: reloading {name} failed: {why}")
    client = ps_client._client()
    with client.lock:
        stale, client.order = client.order.stale_pushes, TableOrder()
        client.order.stale_pushes = stale
    context.discard_step()
    where = directory if directory is not None else "the seeded initial tables (no checkpoint saved)"
    logger.warning("distopt.ps: recovered %s: every server reloaded from %s",
                   ", ".join(restarted) or "no restarted server", where)  # fmt: skip
    return Recovery(checkpoint=directory, restarted=restarted)
