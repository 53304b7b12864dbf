"""Forming the RPC group (servers + trainers) on loopback, with deadlines instead of hangs.

Why not plain ``rpc.init_rpc(init_method="tcp://127.0.0.1:P")``: rank 0 then hosts a TCPStore that
listens on the *wildcard* address whatever host the URL names, a rank whose store host is down
waits 30 minutes, and the store dies with rank 0 while others still use it to shut down. Instead
the launcher hosts the store on a socket it bound to ``ServerOptions.host``; every member joins as
a store *client* (torch's ``TORCHELASTIC_USE_AGENT_STORE`` mode) after probing the store with the
configured deadline.
TensorPipe and gloo bind to ``ServerOptions.interface`` (``TP_SOCKET_IFNAME``/``GLOO_SOCKET_IFNAME``).
Verified with ``ss -ltnp``: every listener of a job is on 127.0.0.1 (``tests/ps/test_launch.py``).
"""

from __future__ import annotations

import contextlib
import datetime
import os
import socket
import time
from collections.abc import Iterator, Sequence

import torch.distributed as dist
import torch.distributed.rpc as rpc

from distopt.errors import RemoteCallError
from distopt.ps.spec import ServerOptions

_AGENT_STORE_ENV = "TORCHELASTIC_USE_AGENT_STORE"
_PROBE_INTERVAL_S = 0.1
READY_PREFIX = "distopt/ready/"


def free_port(host: str = "127.0.0.1", *, consecutive: int = 1) -> int:
    """A port ``p`` on ``host`` with ``p .. p + consecutive - 1`` free right now.

    Binding port 0 and releasing it is racy by nature (another process may take the port before
    the caller binds it); callers that can hand a bound socket over (:func:`host_store`) should.
    """
    for _ in range(100):
        with bind_store_socket_at(host, 0) as first:
            port = int(first.getsockname()[1])
            if port + consecutive > 65536:
                continue
            try:
                for offset in range(1, consecutive):
                    bind_store_socket_at(host, port + offset).close()
            except OSError:
                continue
            return port
    raise RuntimeError(f"no {consecutive} consecutive free ports on {host}")


def bind_store_socket(host: str) -> socket.socket:
    """A listening socket on ``host`` and a free port (port 0), for server 0's store."""
    return bind_store_socket_at(host, 0)


def bind_store_socket_at(host: str, port: int) -> socket.socket:
    """A listening socket on ``host:port`` (``port=0``: a free one) to serve a TCPStore from."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(128)
    return sock


def host_store(host: str, port: int, timeout_s: float) -> dist.TCPStore:
    """A TCPStore server on ``host:port`` only (``port=0``: a free one; read ``store.port``)."""
    sock = bind_store_socket_at(host, port)
    # The store takes over the listening socket: detach so Python never closes it underneath.
    fd = sock.detach()
    return dist.TCPStore(
        host,
        0,
        None,
        True,
        timeout=datetime.timedelta(seconds=timeout_s),
        wait_for_workers=False,
        master_listen_fd=fd,
    )


def connect_store(
    host: str, port: int, timeout_s: float, *, what: str = "parameter-server job store"
) -> dist.TCPStore:
    """A client of the store at ``host:port``, connected within ``timeout_s`` or a clear error.

    The port is probed first, with our own deadline: TCPStore's client retries with a random
    back-off of up to a few seconds between attempts, so a dead store would fail after up to
    about twice the timeout plus that back-off (measured: 5.0 s for a 1.5 s timeout).
    """
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection((host, port), timeout=max(0.05, deadline - time.monotonic())):
                break
        except OSError as err:
            if time.monotonic() + _PROBE_INTERVAL_S >= deadline:
                raise RemoteCallError(f"{what} at {host}:{port} unreachable after {timeout_s:g} s: {err}") from None
            time.sleep(_PROBE_INTERVAL_S)
    try:
        remaining = max(deadline - time.monotonic(), 1.0)  # the store answered: give the handshake time
        return dist.TCPStore(
            host, port, None, False, timeout=datetime.timedelta(seconds=remaining), wait_for_workers=False
        )
    except (RuntimeError, dist.DistNetworkError) as err:
        raise RemoteCallError(
            f"{what} at {host}:{port} unreachable after {timeout_s:g} s: {_first_line(err)}"
        ) from None


def meet(host: str, port: int, *, me: str, others: Sequence[str], timeout_s: float) -> None:
    """Announce ``me`` in the job's store and wait until every name in ``others`` has too.

    ``init_rpc`` itself waits for missing members with a gloo timeout of weeks; meeting first turns
    a server that never starts (or a trainer that never comes) into an error naming it.
    """
    store = connect_store(host, port, timeout_s)
    store.set(READY_PREFIX + me, str(os.getpid()))
    try:
        store.wait([READY_PREFIX + o for o in others], datetime.timedelta(seconds=timeout_s))
    except (RuntimeError, dist.DistError) as err:
        missing = [o for o in others if not store.check([READY_PREFIX + o])]
        names = ", ".join(missing) or _first_line(err)
        raise RemoteCallError(f"{me}: {names} did not join the job at {host}:{port} within {timeout_s:g} s") from None


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def set_interface_env(options: ServerOptions) -> None:
    """Make TensorPipe and gloo listen only on ``options.interface`` (loopback by default)."""
    os.environ["TP_SOCKET_IFNAME"] = options.interface
    os.environ["GLOO_SOCKET_IFNAME"] = options.interface


@contextlib.contextmanager
def _agent_store_mode() -> Iterator[None]:
    """Every member is a store client while ``init_rpc`` runs (the store lives on server 0)."""
    before = os.environ.get(_AGENT_STORE_ENV)
    os.environ[_AGENT_STORE_ENV] = "True"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(_AGENT_STORE_ENV, None)
        else:
            os.environ[_AGENT_STORE_ENV] = before


def _fresh_process_rpc_state() -> None:
    """Make this process join a new group as if it never joined one (a trainer's 2nd job).

    torch keeps two per-process counters that every member must agree on: the store prefix of
    ``init_rpc`` (``rpc_prefix_<n>``) and the sequence ids of the RPC all-gather used at init and
    shutdown (keyed by the members' names). Each job has a fresh store and fresh server processes
    (counters at 0), so a trainer that already left a job must restart from 0 too, or it never meets
    them. Guarded by ``hasattr``: private torch state, absent names mean nothing to reset.
    """
    if hasattr(rpc, "_init_counter") and hasattr(rpc, "_init_counter_lock"):
        with rpc._init_counter_lock:
            rpc._init_counter = 0
    api = rpc.api
    if hasattr(api, "_all_gather_dict_lock"):
        with api._all_gather_dict_lock:
            getattr(api, "_all_gather_sequence_id", {}).clear()
            getattr(api, "_all_gather_sequence_id_to_states", {}).clear()


def init_rpc(
    *, name: str, rank: int, world_size: int, port: int, options: ServerOptions, timeout_s: float
) -> None:
    """Join the RPC group as ``name``; the group must form within ``timeout_s``."""
    set_interface_env(options)
    backend = rpc.TensorPipeRpcBackendOptions(
        init_method=f"tcp://{options.host}:{port}",
        rpc_timeout=timeout_s,
        num_worker_threads=options.num_worker_threads,
        _transports=list(options.transports),
    )
    _fresh_process_rpc_state()
    with _agent_store_mode():
        rpc.init_rpc(name, rank=rank, world_size=world_size, rpc_backend_options=backend)
