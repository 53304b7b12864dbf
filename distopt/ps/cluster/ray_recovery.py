"""Going on after Ray restarted a parameter-server actor (``ps.backend: ray``, ``ps.max_restarts``).

:func:`recover` brings every server back to one checkpoint (the job's last, named by its record
file), :func:`servers_ready` says whether every actor answers, :func:`recording` keeps the record
up to date around the servers' saves and loads. The recipe, and why a record file:
``docs/ps_runtime.md`` ("Going on after a Ray restart").
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Iterator
from typing import Any

from distopt.errors import RemoteCallError
from distopt.ps.client import context
from distopt.ps.cluster.job import PSJob
from distopt.ps.cluster.lifecycle import Membership, Recovery
from distopt.ps.server.shard_files import read_record, record_path, write_record
from distopt.ps.spec import ServerOptions
from distopt.ps.transport.ray import RayTransport, ray_message

logger = logging.getLogger(__name__)


@contextlib.contextmanager
def recording(job: PSJob, directory: str) -> Iterator[None]:
    """Around a save into or a load from ``directory`` by every server of ``job``: on success,
    record it as the job's last checkpoint."""
    assert job.ray_namespace is not None
    path = record_path(job.options, job.ray_namespace)
    directory = os.path.abspath(directory)
    if read_record(path) == directory:
        path.unlink(missing_ok=True)  # its files are about to be rewritten one by one
    yield
    write_record(path, directory)


def _transport(membership: Membership) -> RayTransport:
    assert isinstance(membership.transport, RayTransport)
    return membership.transport


def _poll(transport: RayTransport, timeout_s: float, *, give_up: bool) -> dict[str, Any]:
    """Every actor's ``incarnation()`` answer, asked again until all answer or ``timeout_s`` has
    passed (a dead actor fails calls until Ray has restarted it); with ``give_up``, after the first
    round. Missing answers are the exception (``None``: no answer in time)."""
    deadline = time.monotonic() + timeout_s
    while True:
        answers = transport.ask_all("incarnation", (), max(0.1, deadline - time.monotonic()))
        done = all(isinstance(a, dict) for a in answers.values())
        if give_up or time.monotonic() >= deadline or done:
            return answers
        time.sleep(0.2)


def servers_ready(membership: Membership, timeout_s: float) -> bool:
    """Whether every server actor of this trainer's Ray job answers within ``timeout_s`` (a
    restarted one once its constructor has reloaded the checkpoint)."""
    give_up = membership.job.options.max_restarts == 0
    answers = _poll(_transport(membership), timeout_s, give_up=give_up)
    return all(isinstance(a, dict) for a in answers.values())


def _wait_for_servers(transport: RayTransport, options: ServerOptions) -> dict[str, dict[str, Any]]:
    """Every actor's ``incarnation()``, once each answers; a one-line error naming the first that
    does not within ``options.start_timeout_s`` (at once with ``max_restarts: 0``)."""
    answers = _poll(transport, options.start_timeout_s, give_up=options.max_restarts == 0)
    missing = {name: a for name, a in answers.items() if not isinstance(a, dict)}
    if not missing:
        return answers
    name, answer = sorted(missing.items())[0]
    why = "no answer" if answer is None else ray_message(answer)
    if options.max_restarts == 0:
        raise RemoteCallError(
            f"distopt.ps.recover: {name} is gone and Ray does not restart it "
            f"(ps.max_restarts=0): {why}"
        )
    raise RemoteCallError(
        f"distopt.ps.recover: {name} did not come back within {options.start_timeout_s:g} s "
        f"(ps.start_timeout_s; Ray restarts it at most ps.max_restarts={options.max_restarts} "
        f"times): {why}"
    )


def recover(membership: Membership, directory: str | None = None) -> Recovery:
    """Bring every server of this trainer's ``ps.backend: ray`` job back to one checkpoint.

    ``directory``: the checkpoint to reload (a :func:`~distopt.ps.save_servers` directory); by
    default the job's last one (see the module), the seeded initial tables if it saved none.
    Waits for this trainer's calls to be answered, then for every actor (a restarted one within
    ``ps.start_timeout_s``), reloads every server and clears this trainer's per-table order and
    the step's fetched rows. Raises :class:`RemoteCallError` naming a server that does not come
    back. Several trainers: all stop, call ``recover`` after a barrier (it is idempotent), and
    start again after another barrier.
    """
    job, client, transport = membership.job, membership.client, _transport(membership)
    assert client is not None and job.ray_namespace is not None
    options = job.options
    client.flush()
    unanswered = transport.quiesce(options.rpc_timeout_s)
    if unanswered:
        raise RemoteCallError(
            f"distopt.ps.recover: {unanswered} calls still unanswered after "
            f"{options.rpc_timeout_s:g} s (ps.rpc_timeout_s): a server is stuck"
        )
    before = _wait_for_servers(transport, options)
    restarted = tuple(sorted(name for name, info in before.items() if info["fenced"]))
    for name in restarted:
        logger.warning("distopt.ps: %s", before[name]["note"])
    if directory is None:
        directory = read_record(record_path(options, job.ray_namespace))
    else:
        directory = os.path.abspath(directory)
    reloaded = transport.ask_all("restore", (directory,), options.rpc_timeout_s)
    for name, answer in sorted(reloaded.items()):
        if not isinstance(answer, str):
            why = "no answer" if answer is None else ray_message(answer)
            raise RemoteCallError(f"distopt.ps.recover: reloading {name} failed: {why}")
    client.forget_order()
    context.discard_step()
    where = (
        directory if directory is not None else "the seeded initial tables (no checkpoint saved)"
    )
    logger.warning(
        "distopt.ps: recovered %s: every server reloaded from %s",
        ", ".join(restarted) or "no restarted server",
        where,
    )
    return Recovery(checkpoint=directory, restarted=restarted)
