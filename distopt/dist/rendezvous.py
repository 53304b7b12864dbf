"""Rendezvous for every distopt job: hosting and joining stores, forming the RPC and gloo groups.

Who hosts which store is data, not a convention: a :class:`StorePlan` gives a job's stores, the
one address they listen on and the one member that hosts them. The plans in use:

====================================  ===============  ==========================================
job                                   ``hosted_by``    stores
====================================  ===============  ==========================================
``distopt.ps.start_servers``          ``launcher``     RPC group and trainers' gloo group, on free
                                                       ports of ``ServerOptions.host``
``distopt.train`` with servers        ``ps0``          RPC group at ``DISTOPT_PS_ADDR``, trainers'
(TorchX ``ps_job``, supervise)                         gloo group at ``DISTOPT_DDP_PORT``
``distopt.train``, trainers only      ``trainer0``     gloo group at ``MASTER_ADDR:MASTER_PORT``
``distopt.train`` with Ray actor      ``trainer0``     the same; the server actors are found by
servers (``ps.backend: ray``)                          name through Ray (``distopt.roles.ray_roles``)
:func:`spawned_gloo` (benchmarks,     ``launcher``     gloo group on a free port of 127.0.0.1
``mp.spawn`` workers)
====================================  ===============  ==========================================

The host is the process that outlives the others' use of the stores: the launching process, or
server 0, which serves until every trainer has finished. It hosts with :func:`host_stores`, always
on a socket bound to the plan's host alone (``TCPStore``'s own server listens on the wildcard
address whatever host it is given, and so does ``init_rpc(init_method="tcp://...")``). Every
member, the host included, then joins as a store client, and only through a probe (below).
TensorPipe and gloo bind to one interface (:mod:`distopt.dist.netif`): by default that of the route
toward the plan's host (``lo`` on a loopback plan).

Deadlines, one policy: each call takes its caller's ``timeout_s`` and either finishes within it or
raises one :class:`~distopt.errors.RemoteCallError` line naming the member, the store (what, where,
hosted by whom) and what is missing. Stores are probed under our own deadline before ``TCPStore``
connects, because its client retries with a random back-off of up to a few seconds (measured: a
1.5 s timeout took 5.0 s).
"""

from __future__ import annotations

import torch.multiprocessing as mp
import errno
import atexit
import contextlib
import dataclasses
import datetime
import faulthandler
import gc
import hashlib
import ipaddress
import os
import random
import re
import socket
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Literal, Protocol

import torch.distributed as dist
import torch.distributed.rpc as rpc

from distopt.config import check
from distopt.dist import netif
from distopt.errors import ConfigError, RemoteCallError

Store = Literal["rpc", "gloo"]
_STORE_NAMES: dict[Store, str] = {"rpc": "RPC group store", "gloo": "trainers' gloo store"}
_AGENT_STORE_ENV = "TORCHELASTIC_USE_AGENT_STORE"
_PROBE_INTERVAL_S = 0.1
_MIN_HANDSHAKE_S = 1.0
READY_PREFIX = "distopt/ready/"
LEFT_PREFIX = "distopt/left/"
_GLOO_BACKEND_WARNING = r"You are using a Backend <class 'torch\.distributed\.distributed_c10d\.ProcessGroupGloo'> as a ProcessGroup"


@dataclasses.dataclass(kw_only=True, slots=True, frozen=True)
class StorePlan:
    """Where a job's rendezvous stores listen and which member hosts them (plain, picklable)."""

    host: str
    """The address every store listens on, and nothing else."""
    hosted_by: str
    """Name of the member that hosts every store of the plan (``launcher``, ``ps0``, ``trainer0``)."""
    rpc_port: int | None = None
    """Port of the RPC group's store (servers and trainers); ``None``: no RPC group. ``0`` asks
    :func:`host_stores` for a free port (the plan it returns has the port taken)."""
    gloo_port: int | None = None
    """Port of the trainers' gloo group's store; ``None``: no gloo group. ``0``: as above."""

    def __post_init__(self) -> None:
        check(bool(self.host), "rendezvous.host", "a host address", self.host)
        check(bool(self.hosted_by), "rendezvous.hosted_by", "a member name", self.hosted_by)
        for key in ("rpc_port", "gloo_port"):
            port = getattr(self, key)
            check(
                port is None or 0 <= port < 65536, f"rendezvous.{key}", "a port in 0..65535", port
            )

    def port(self, store: Store) -> int:
        """The port of ``store``; a one-line error when the plan has none."""
        port = self.rpc_port if store == "rpc" else self.gloo_port
        if not port:
            name = _STORE_NAMES[store]
            raise ConfigError(
                f"rendezvous.{store}_port: expected the port of the {name}, got {port!r}"
            )
        return port

    def describe(self, store: Store) -> str:
        """``RPC group store (hosted by ps0) at 127.0.0.1:29500``: how errors name a store."""
        return (
            f"{_STORE_NAMES[store]} (hosted by {self.hosted_by}) at {self.host}:{self.port(store)}"
        )


class HostedStores:
    """The stores this process hosts for a plan (none unless it is the plan's host).

    Keep it alive while other members use the stores; leaving the ``with`` block closes them.
    """

    def __init__(self, plan: StorePlan, stores: dict[Store, dist.TCPStore]) -> None:
        self.plan = plan
        """The plan with the ports actually taken (what the other members need)."""
        self._stores = stores

    def __enter__(self) -> HostedStores:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def wait_until_left(self, members: Sequence[str], *, timeout_s: float) -> list[str]:
        """Wait up to ``timeout_s`` for every name in ``members`` to :func:`leave`; those that did not.

        Bounded, not an error: a member that died after finishing its work must not hold the host.
        """
        store = self._stores.get("rpc")
        if store is None or not members:
            return []
        with contextlib.suppress(RuntimeError, dist.DistError):
            store.wait([LEFT_PREFIX + m for m in members], datetime.timedelta(seconds=timeout_s))
        return [m for m in members if not store.check([LEFT_PREFIX + m])]

    def close(self) -> None:
        """Stop serving: a ``TCPStore`` server shuts down with its last reference."""
        self._stores.clear()


def host_stores(plan: StorePlan, *, me: str, timeout_s: float) -> HostedStores:
    """Host every store of ``plan`` if ``me`` is its host (else host nothing), bound to ``plan.host``."""
    if me != plan.hosted_by:
        return HostedStores(plan, {})
    netif.check_not_loopback_across_hosts(
        plan.host, nodes=netif.job_nodes(), address_key="MASTER_ADDR"
    )
    stores: dict[Store, dist.TCPStore] = {}
    wanted: tuple[tuple[Store, int | None], ...] = (
        ("rpc", plan.rpc_port),
        ("gloo", plan.gloo_port),
    )
    for store, port in wanted:
        if port is None:
            continue
        try:
            stores[store] = _host_store(plan.host, port, timeout_s)
        except OSError as err:
            raise ConfigError(
                f"{me}: cannot host the {_STORE_NAMES[store]} on {plan.host}:{port}: "
                f"{err.strerror or err}{_not_here(plan.host, err)}"
            ) from None
    taken = {store: int(s.port) for store, s in stores.items()}
    hosted = dataclasses.replace(plan, rpc_port=taken.get("rpc"), gloo_port=taken.get("gloo"))
    return HostedStores(hosted, stores)


def meet(plan: StorePlan, *, me: str, others: Sequence[str], timeout_s: float) -> None:
    """Announce ``me`` in the RPC group's store and wait until every name in ``others`` has too.

    ``init_rpc`` itself waits for missing members with a gloo timeout of weeks; meeting first turns
    a server that never starts (or a trainer that never comes) into an error naming it.
    """
    store = _connect(plan, "rpc", me=me, timeout_s=timeout_s)
    store.set(READY_PREFIX + me, str(os.getpid()))
    try:
        store.wait([READY_PREFIX + o for o in others], datetime.timedelta(seconds=timeout_s))
    except (RuntimeError, dist.DistError) as err:
        missing = [o for o in others if not store.check([READY_PREFIX + o])]
        names = ", ".join(missing) or first_line(err)
        raise RemoteCallError(
            f"{me}: {names} did not join the job at {plan.host}:{plan.port('rpc')} within {timeout_s:g} s"
        ) from None


def leave(plan: StorePlan, *, me: str, timeout_s: float) -> None:
    """Tell the host ``me`` is done with the stores (see :meth:`HostedStores.wait_until_left`)."""
    _connect(plan, "rpc", me=me, timeout_s=timeout_s).set(LEFT_PREFIX + me, str(os.getpid()))


class RpcTransport(Protocol):
    """How a member's TensorPipe agent runs (``distopt.ps.ServerOptions`` is one)."""

    @property
    def interface(self) -> str: ...
    @property
    def num_worker_threads(self) -> int: ...
    @property
    def transports(self) -> tuple[str, ...]: ...
    @property
    def channels(self) -> tuple[str, ...] | None: ...


def init_rpc(
    plan: StorePlan,
    *,
    name: str,
    rank: int,
    world_size: int,
    transport: RpcTransport,
    timeout_s: float,
) -> None:
    """Join the RPC group as ``name`` through ``plan``'s RPC store; it must form within ``timeout_s``.

    Call :func:`meet` first: torch connects to the store itself, without our probe.
    """
    backend = rpc.TensorPipeRpcBackendOptions(
        init_method=f"{_RPC_SCHEME}://{plan.host}:{plan.port('rpc')}",
        rpc_timeout=timeout_s,
        num_worker_threads=transport.num_worker_threads,
        _transports=list(transport.transports),
        _channels=None if transport.channels is None else list(transport.channels),
    )
    _fresh_process_rpc_state()
    _register_rpc_scheme()
    interface = transport.interface
    try:
        with (
            netif.pinned(interface, toward=plan.host, key=_interface_key(interface)),
            _agent_store_mode(),
            warnings.catch_warnings(),
        ):
            # torch's own init_rpc gathers device maps through a ProcessGroupGloo backend object
            # (torch/distributed/rpc/backend_registry.py), which torch itself deprecates; nothing
            # the caller can change, so only that warning, and only inside this call.
            warnings.filterwarnings("ignore", message=_GLOO_BACKEND_WARNING, category=UserWarning)
            rpc.init_rpc(name, rank=rank, world_size=world_size, rpc_backend_options=backend)
    except ConfigError:  # the interface setting, checked before anything is made
        raise
    except Exception as err:
        raise RemoteCallError(
            f"{name}: RPC group of {world_size} did not form within {timeout_s:g} s through the "
            f"{plan.describe('rpc')}: {first_line(err)}"
        ) from None
    members = [info.name for info in rpc.api._get_current_rpc_agent().get_worker_infos()]
    store = _connect(plan, "rpc", me=name, timeout_s=timeout_s)
    # A member that joined without meet() (a caller of torch's init_rpc alone) numbers its
    # barriers its own way: then the group leaves as torch's own shutdown does.
    _QUIET_LEAVE[:] = [store.check([READY_PREFIX + member for member in members])]


def leave_rpc(*, me: str, graceful: bool) -> None:
    """Leave the RPC group: with ``graceful``, together with every other member where they can.

    A TensorPipe agent logs a warning for every pipe that closes while it is not shutting down
    (``RPC agent for ps0 encountered error when reading incoming request from trainer0: EOF``,
    ``... pipe closed``), and ``rpc.shutdown(graceful=False)`` closes pipes at once, so every
    member's exit warned on itself and the others. The agent's ``join(shutdown=True)`` waits until
    no member has a call in flight (a server's answer to the last goodbye included), then marks
    every agent shutting down, through barriers in the RPC group's store whose deadline is the
    group's RPC timeout, before any pipe closes. Those barriers are numbered per process by torch;
    :class:`_GroupBarrierStore` numbers them per group, so a trainer on its second job (a Python
    process running jobs one after another, as a benchmark sweep does) meets fresh servers on the
    same keys. (Not ``rpc.shutdown(graceful=True)``: its all-gather has per-process sequence
    numbers too.) A member that never comes costs that deadline and one line.
    """
    if not rpc.api._is_current_rpc_agent_set():
        return
    if graceful and _QUIET_LEAVE == [True]:
        try:
            rpc.api._get_current_rpc_agent().join(shutdown=True)
        except RuntimeError as err:
            print(
                f"{me}: left the RPC group without the others (they did not all reach shutdown "
                f"within the RPC timeout): {first_line(err)}",
                file=sys.stderr,
                flush=True,
            )
    _QUIET_LEAVE[:] = []
    rpc.shutdown(graceful=False)
    _GROUP_STORES.clear()


_QUIET_LEAVE: list[bool] = []
"""Whether every member of the current RPC group can leave it together (:func:`leave_rpc`)."""

_RPC_SCHEME = "distopt-tcp"
"""``init_method`` scheme of the groups :func:`init_rpc` forms: torch's ``tcp://`` rendezvous,
its store seen through :class:`_GroupBarrierStore`."""

_BARRIER_KEY = re.compile(r"^(.*(?:PROCESS_COUNT|ACTIVE_CALLS|READY)_ID_)(\d+)$")
"""The keys of the TensorPipe agent's store barrier (torch/csrc/distributed/rpc/agent_utils.cpp:
``PROCESS_COUNT_ID_<n>``, ``ACTIVE_CALLS_ID_<n>``, ``READY_ID_<n>``, ``n`` counted per process)."""


class _GroupBarrierStore(dist.Store):
    """An RPC group's store as its agent sees it, with the agent's barriers numbered from 1 in
    this group instead of in this process's life.

    Every member of a group runs the same barriers in the same order, so numbered per group they
    agree, whichever jobs each process ran before (see :func:`leave_rpc`). Everything else passes
    through unchanged.
    """

    def __init__(self, store: dist.Store) -> None:
        super().__init__()
        self._store = store
        self._lock = threading.Lock()
        self._base: int | None = None

    def _key(self, key: str) -> str:
        match = _BARRIER_KEY.match(key)
        if match is None:
            return key
        n = int(match.group(2))
        with self._lock:
            if self._base is None:
                self._base = n - 1
            return f"{match.group(1)}{n - self._base}"

    def set(self, key: str, value: Any) -> None:
        self._store.set(self._key(key), value)

    def get(self, key: str) -> bytes:
        return self._store.get(self._key(key))

    def add(self, key: str, value: int) -> int:
        return self._store.add(self._key(key), value)

    def compare_set(self, key: str, expected: Any, desired: Any) -> bytes:
        return self._store.compare_set(self._key(key), expected, desired)

    def wait(self, keys: list[str], timeout: datetime.timedelta | None = None) -> None:
        mapped = [self._key(key) for key in keys]
        if timeout is None:
            self._store.wait(mapped)
        else:
            self._store.wait(mapped, timeout)

    def check(self, keys: list[str]) -> bool:
        return self._store.check([self._key(key) for key in keys])

    def delete_key(self, key: str) -> bool:
        return self._store.delete_key(self._key(key))

    def num_keys(self) -> int:
        return self._store.num_keys()


_GROUP_STORES: list[_GroupBarrierStore] = []
"""The current group's store: torch's agent holds only its C++ part, and a Python store whose
Python object is gone fails every call."""


def _rpc_rendezvous(url: str, **kwargs: Any) -> Iterator[tuple[dist.Store, int, int]]:
    """torch's ``tcp://`` rendezvous, its store wrapped in a :class:`_GroupBarrierStore`."""
    tcp_url = "tcp" + url[len(_RPC_SCHEME) :]
    for store, rank, world_size in dist.rendezvous(tcp_url, **kwargs):
        group_store = _GroupBarrierStore(store)
        _GROUP_STORES[:] = [group_store]
        yield group_store, rank, world_size


def _register_rpc_scheme() -> None:
    """Make ``distopt-tcp://`` an ``init_method`` (once per process)."""
    with contextlib.suppress(RuntimeError):  # already registered
        dist.register_rendezvous_handler(_RPC_SCHEME, _rpc_rendezvous)


def leave_gloo() -> None:
    """Destroy the default process group, after the modules that used it (see :func:`keep_group`).

    Garbage is collected first: a DDP module left in a reference cycle would otherwise be freed
    later, its reducer dropping the last reference to a gloo group while holding the GIL (the
    hang that :func:`keep_group` describes).
    """
    if dist.is_initialized():
        gc.collect()
        dist.destroy_process_group()


_KEPT_GROUPS: list[dist.ProcessGroup] = []


def keep_group(group: dist.ProcessGroup) -> None:
    """Hold a Python reference to ``group`` until the interpreter exits (then collect garbage and
    drop it), so that DDP's C++ reducer never holds its last reference.

    A gloo group's destructor joins its worker threads. When the last reference goes with a DDP
    reducer, that destructor runs with the GIL held (the reducer's binding does not release it),
    while a worker may be freeing a finished all-reduce whose thread-local state holds a Python
    object (since torch stashes the ``contextvars`` context for backward): the worker waits for
    the GIL, the main thread for the worker, for ever (torch 2.13; seen with gdb). A 2-rank
    torchrun script that calls ``destroy_process_group()`` and then lets its DDP model go out of
    scope hung so at exit in 10 of 26 runs with plain DDP here. Freed through its Python object,
    the group is destroyed with the GIL released.
    """
    if not _KEPT_GROUPS:
        atexit.register(_release_groups)
    if all(kept is not group for kept in _KEPT_GROUPS):
        _KEPT_GROUPS.append(group)


def _release_groups() -> None:
    gc.collect()  # modules that died in reference cycles, and their reducers with them
    _KEPT_GROUPS.clear()


@contextlib.contextmanager
def collective(what: str, *, me: str | None = None) -> Iterator[None]:
    """The collectives inside as one step that fails in one line naming this rank and ``what``.

    Their deadline is the process group's timeout (gloo enforces it on every collective); its
    errors (``Timed out waiting 120000ms for recv operation to complete``, ``Connection closed by
    peer``) become ``trainer 1: timed out waiting for the other ranks in <what>: ...``.
    """
    try:
        yield
    except (RuntimeError, dist.DistError) as err:
        raise collective_error(err, what, me=me) or err from None


def collective_error(
    err: BaseException, what: str, *, me: str | None = None, peers: str = "ranks"
) -> RemoteCallError | None:
    """gloo's error of a collective as one line naming this rank and ``what``; ``None`` when it
    is no timeout or lost peer (an error of the caller's own, kept as it is)."""
    text = str(err)
    if me is None:
        me = f"rank {dist.get_rank()}" if dist.is_initialized() else "this process"
    if any(mark in text for mark in _TIMED_OUT):
        why = f"timed out waiting for the other {peers}"
    elif any(mark in text for mark in _PEER_LOST):
        why = f"another of the {peers} left the process group (exited or was killed)"
    else:
        return None
    return RemoteCallError(f"{me}: {why} in {what}: {first_line(err)}")


_TIMED_OUT = ("Timed out waiting", "timed out", "Application timeout caused pair closure")
_PEER_LOST = ("Connection closed by peer", "Connection reset by peer", "Broken pipe")


def init_gloo(plan: StorePlan, *, me: str, rank: int, world_size: int, timeout_s: float) -> None:
    """Form the default process group (gloo) of ``world_size`` trainers through ``plan``'s gloo store.

    gloo listens on ``GLOO_SOCKET_IFNAME`` (checked on this host), else on the interface of the
    route toward the plan's host (:func:`distopt.dist.netif.pin_gloo`: ``lo`` on a loopback plan); else
    gloo would bind the address the hostname resolves to.
    """
    netif.pin_gloo(plan.host)
    store = _connect(plan, "gloo", me=me, timeout_s=timeout_s)
    try:
        dist.init_process_group(
            "gloo",
            store=store,
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
    except (RuntimeError, dist.DistError) as err:
        raise RemoteCallError(
            f"{me}: gloo group of {world_size} trainers did not form within {timeout_s:g} s through "
            f"the {plan.describe('gloo')}: {first_line(err)}"
        ) from None


@contextlib.contextmanager
def spawned_gloo(*, timeout_s: float = 60.0) -> Iterator[StorePlan]:
    """Host a gloo store on 127.0.0.1 for the processes this one is about to spawn; yields the plan.

    The store listens from before the spawn until the ``with`` block ends, so no other process can
    take its port in between (as with a port picked by :func:`free_port` and released: CI lost a
    benchmark to that race). Each spawned process calls :func:`init_gloo` with the plan.
    """
    plan = StorePlan(host="127.0.0.1", hosted_by="launcher", gloo_port=0)
    with host_stores(plan, me="launcher", timeout_s=timeout_s) as hosted:
        yield hosted.plan


def run_spawned(
    fn: Callable[..., None], *args: Any, world_size: int, what: str, timeout_s: float = 120.0
) -> None:
    """``fn(rank, *args)`` on ``world_size`` spawned processes of one gloo group (as TorchRec's
    multi-process test helper), each ended in order: ``fn``'s frame, then its garbage, then the
    group (:func:`leave_gloo`), so no gloo group is freed while the interpreter is torn down.

    Each process prints every thread's stack on a fault (``faulthandler``), and a process that
    dies is one line naming it: ``<what>: rank 1 terminated with signal SIGABRT (its stack is
    printed above)``, one that raises the last line of its traceback. ``fn`` and ``args`` must be
    picklable (module-level).
    """
    with spawned_gloo(timeout_s=timeout_s) as plan:
        try:
            mp.spawn(
                _spawned_rank,
                args=(fn, plan, world_size, timeout_s, args),
                nprocs=world_size,
                join=True,
            )
        except mp.ProcessExitedException as err:
            raise RemoteCallError(
                f"{what}: rank {err.error_index} {str(err).partition(' ')[2].partition(' ')[2]} "
                "(its stack, where Python could print one, is above)"
            ) from None
        except mp.ProcessRaisedException as err:  # its traceback's last line: the error itself
            last = [line for line in str(err).strip().splitlines() if line.strip()][-1]
            raise RemoteCallError(f"{what}: rank {err.error_index} failed: {last}") from None


def _spawned_rank(
    rank: int,
    fn: Callable[..., None],
    plan: StorePlan,
    world_size: int,
    timeout_s: float,
    args: tuple[Any, ...],
) -> None:
    faulthandler.enable(all_threads=True)
    init_gloo(plan, me=f"rank{rank}", rank=rank, world_size=world_size, timeout_s=timeout_s)
    try:
        fn(rank, *args)
    finally:
        leave_gloo()


def _interface_key(interface: str) -> str:
    """The key that set a member's interface: the environment (the launcher's ``--iface``) when
    it names this one, else ``ps.interface``."""
    return netif.ENV_KEY if interface == netif.from_environ() else "ps.interface"


def _not_here(host: str, err: OSError) -> str:
    """Why a store cannot listen on ``host``: no address of this host, or its port taken."""
    if err.errno == errno.EADDRINUSE:
        return (
            " (another process listens there, perhaps another job: launch this one with "
            "--arg master_port=P, P and P + 1 free on that host)"
        )
    if err.errno != errno.EADDRNOTAVAIL:
        return ""
    return (
        f" ({host} is no address of {netif.hostname()}: set MASTER_ADDR, or ps.host from Python, "
        "to an address of the host that runs this member)"
    )


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


LISTEN_PORTS = range(20000, 32768)
"""Where :func:`free_port` and :func:`run_port` pick the ports a job listens on: below Linux's
default ephemeral range (32768–60999), from which outgoing connections take their source ports.
A port in that range that nothing listens on yet can be taken by a client connecting to it: a
TCPStore client that retries while its server starts can connect to itself (same source and
destination port), fail the store's ping ("invalid value returned from server") and hold the
port the server then cannot bind (the suite's Ray job on port 42129, 2026-11-29)."""
RUN_PORTS = LISTEN_PORTS[::2]
"""Where :func:`run_port` picks: :data:`LISTEN_PORTS` in steps of two (a job takes P and P + 1)."""


def ephemeral_ports() -> range:
    """This host's ephemeral port range (``net.ipv4.ip_local_port_range``; Linux's default
    where it cannot be read)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = map(int, f.read().split())
        return range(low, high + 1)
    except (OSError, ValueError):
        return range(32768, 61000)


def free_port(host: str = "127.0.0.1", *, consecutive: int = 1) -> int:
    """A port ``p`` on ``host`` with ``p .. p + consecutive - 1`` free right now, outside the
    host's ephemeral range (:data:`LISTEN_PORTS`, else above the ephemeral range).

    Checking and releasing a port is racy by nature (another process may take the port before
    the caller binds it); callers that can host on port 0 (:func:`host_stores`) should.
    """
    ephemeral = ephemeral_ports()

    def outside(ports: range) -> list[int]:
        last = consecutive - 1
        return [
            p for p in ports if p + last < 65536 and p not in ephemeral and p + last not in ephemeral
        ]

    candidates = outside(LISTEN_PORTS) or outside(range(ephemeral.stop, 65536))
    rng = random.Random()  # not the job's seeded generator: two processes must not pick alike
    for port in rng.sample(candidates, min(200, len(candidates))):
        try:
            for offset in range(consecutive):
                _bind(host, port + offset).close()
        except OSError:
            continue
        return port
    raise RuntimeError(
        f"no {consecutive} consecutive free ports on {host} outside its ephemeral range "
        f"({ephemeral.start}–{ephemeral.stop - 1})"
    )


def run_port(run_id: str) -> int:
    """A port ``P`` of run ``run_id``'s own (it uses ``P`` and ``P + 1``), the same wherever it is
    computed: for a job whose first host is not known when it is submitted (Slurm, Ray), where
    :func:`free_port` cannot look. Two runs at once share one with probability 1/6384."""
    digest = hashlib.sha256(run_id.encode()).digest()
    return RUN_PORTS[int.from_bytes(digest[:8], "big") % len(RUN_PORTS)]


def _bind(host: str, port: int) -> socket.socket:
    """A listening socket on ``host:port`` alone (``port=0``: a free one)."""
    address = "127.0.0.1" if host == "localhost" else host
    sock = socket.socket(socket.AF_INET6 if ":" in address else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((address, port))
        sock.listen(256)
    except OSError:
        sock.close()
        raise
    return sock


def _host_store(host: str, port: int, timeout_s: float) -> dist.TCPStore:
    """A TCPStore server on ``host:port`` only (``port=0``: a free one; read ``store.port``)."""
    # The store takes over the listening socket: detach so Python never closes it underneath.
    fd = _bind(host, port).detach()
    return dist.TCPStore(
        host,
        0,
        None,
        True,
        timeout=datetime.timedelta(seconds=timeout_s),
        wait_for_workers=False,
        master_listen_fd=fd,
    )


def probe(host: str, port: int, *, timeout_s: float) -> OSError | None:
    """Try a TCP connection to ``host:port`` until one succeeds or ``timeout_s`` passes (a peer may
    still be starting); ``None`` once it answers, else the last error."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection(
                (host, port), timeout=max(0.05, deadline - time.monotonic())
            ):
                return None
        except OSError as err:
            if time.monotonic() + _PROBE_INTERVAL_S >= deadline:
                return err
            time.sleep(_PROBE_INTERVAL_S)


def _connect(plan: StorePlan, store: Store, *, me: str, timeout_s: float) -> dist.TCPStore:
    """A client of ``plan``'s ``store``, connected within ``timeout_s`` or a one-line error."""
    host, port = plan.host, plan.port(store)
    deadline = time.monotonic() + timeout_s
    refused = probe(host, port, timeout_s=timeout_s)
    if refused is not None:
        raise RemoteCallError(
            f"{me}: {plan.describe(store)} unreachable after {timeout_s:g} s: "
            f"{first_line(refused)}{_from_where(plan, me)}"
        )
    try:
        # The store answered: give the handshake time even when the probe used up the deadline.
        remaining = max(deadline - time.monotonic(), _MIN_HANDSHAKE_S)
        return dist.TCPStore(
            host,
            port,
            None,
            False,
            timeout=datetime.timedelta(seconds=remaining),
            wait_for_workers=False,
        )
    except (RuntimeError, dist.DistNetworkError) as err:
        raise RemoteCallError(
            f"{me}: {plan.describe(store)} unreachable after {timeout_s:g} s: {first_line(err)}"
        ) from None


def _from_where(plan: StorePlan, me: str) -> str:
    """Which host could not reach a store, and what a loopback answer there means; nothing for a
    loopback plan (a job on one host)."""
    if is_loopback(plan.host):
        return ""
    try:
        addr = socket.getaddrinfo(plan.host, None, type=socket.SOCK_STREAM)[0][4][0]
    except OSError:
        return f" (from {netif.hostname()})"
    if ipaddress.ip_address(addr).is_loopback and me != plan.hosted_by:
        return (
            f" (from {netif.hostname()}, where {plan.host} resolves to {addr}, a loopback address: "
            f"map {plan.host} to its network address in /etc/hosts, or set MASTER_ADDR to it)"
        )
    return f" (from {netif.hostname()}" + (f", {plan.host} = {addr})" if addr != plan.host else ")")


def first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


@contextlib.contextmanager
def _agent_store_mode() -> Iterator[None]:
    """Every member is a store client while ``init_rpc`` runs (the host serves the store)."""
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
