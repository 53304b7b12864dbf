"""Validated descriptions of parameter-server tables and of the server processes that hold them.

A table is a ``[num_rows, dim]`` float tensor. Row ``r`` of a table placed on servers
``(s_0, ..., s_{n-1})`` lives on server ``s_{r % n}`` at local row ``r // n``. An embedding table is
spread over every server by default; a dense table lives whole on one server.
"""

from __future__ import annotations

import dataclasses
import zlib
from typing import Any, Literal

from distopt.config import check

Optimizer = Literal["sgd", "adagrad", "rowwise_adagrad"]
OPTIMIZERS: tuple[str, ...] = ("sgd", "adagrad", "rowwise_adagrad")
BACKENDS: tuple[str, ...] = ("rpc", "ray")
PlacementStrategy = Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"]
PLACEMENTS: tuple[str, ...] = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")
CHANNELS: tuple[str, ...] = (
    "basic",
    "cma",
    "mpt_uv",
    "cuda_basic",
    "cuda_ipc",
    "cuda_gdr",
    "cuda_xth",
)
"""TensorPipe's channel names (``ps.channels``)."""
CachePolicy = Literal["lru", "lfu"]
Consistency = Literal["exact", "staleness"]


def server_name(index: int) -> str:
    """RPC worker name of parameter server ``index`` (``ps0``, ``ps1``, ...)."""
    return f"ps{index}"


def trainer_name(index: int) -> str:
    """RPC worker name of trainer ``index`` (``trainer0``, ...)."""
    return f"trainer{index}"


@dataclasses.dataclass(kw_only=True, slots=True, frozen=True)
class TableSpec:
    """One named table held by the parameter servers."""

    name: str
    """Table name used in ``fetch(name, ids)``; unique within a job."""
    num_rows: int
    """Number of rows (embedding ids ``0 .. num_rows - 1``)."""
    dim: int
    """Width of a row."""
    kind: Literal["embedding", "dense"] = "embedding"
    """``embedding``: sharded by ``row % n`` over ``servers``; ``dense``: whole on one server."""
    optimizer: Optimizer = "sgd"
    """Update applied by ``push`` (duplicate ids accumulate first): sparse SGD, sparse Adagrad (one
    accumulator per element), or row-wise Adagrad (one accumulator per row holding the running sum
    of the row's mean squared gradient, as TorchRec/FBGEMM's ``EXACT_ROWWISE_ADAGRAD``: ``dim``
    times less optimizer state, the usual choice for large embedding tables)."""
    init_std: float = 0.01
    """Rows start as ``normal(0, init_std)`` drawn from the job seed and the table name."""
    adagrad_eps: float = 1e-10
    """Adagrad denominator term: ``w -= lr * g / (sqrt(sum g^2) + eps)`` (both Adagrad kinds)."""
    adagrad_initial: float = 0.0
    """Initial value of the Adagrad squared-gradient accumulator (both Adagrad kinds)."""
    servers: tuple[int, ...] | None = None
    """Indices of the servers holding the table; ``None``: all servers (embedding) or one chosen
    from the name (dense)."""

    def __post_init__(self) -> None:
        key = f"tables.{self.name}" if isinstance(self.name, str) else "tables"
        check(
            isinstance(self.name, str) and bool(self.name),
            "tables.name",
            "a non-empty string",
            self.name,
        )
        check(self.num_rows >= 1, f"{key}.num_rows", "an integer >= 1", self.num_rows)
        check(self.dim >= 1, f"{key}.dim", "an integer >= 1", self.dim)
        check(
            self.kind in ("embedding", "dense"), f"{key}.kind", "'embedding' or 'dense'", self.kind
        )
        check(
            self.optimizer in OPTIMIZERS,
            f"{key}.optimizer",
            "one of " + ", ".join(map(repr, OPTIMIZERS)),
            self.optimizer,
        )
        check(self.init_std >= 0, f"{key}.init_std", "a number >= 0", self.init_std)
        check(self.adagrad_eps > 0, f"{key}.adagrad_eps", "a number > 0", self.adagrad_eps)
        check(
            self.adagrad_initial >= 0,
            f"{key}.adagrad_initial",
            "a number >= 0",
            self.adagrad_initial,
        )
        if self.servers is not None:
            ok = len(self.servers) >= 1 and len(set(self.servers)) == len(self.servers)
            check(
                ok and min(self.servers) >= 0,
                f"{key}.servers",
                "distinct server indices",
                self.servers,
            )
            if self.kind == "dense":
                check(
                    len(self.servers) == 1,
                    f"{key}.servers",
                    "one server for a dense table",
                    self.servers,
                )

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TableSpec:
        """A spec from its fields as JSON or a server's answer hold them (lists for tuples)."""
        fields: dict[str, Any] = {
            k: tuple(v) if isinstance(v, list) else v for k, v in data.items()
        }
        return cls(**fields)

    def placement(self, num_servers: int) -> tuple[int, ...]:
        """Server indices holding shards ``0, 1, ...`` of this table in a job of ``num_servers``."""
        if self.servers is not None:
            check(
                max(self.servers) < num_servers,
                f"tables.{self.name}.servers",
                f"indices below num_servers={num_servers}",
                self.servers,
            )
            return self.servers
        if self.kind == "dense":
            return (zlib.crc32(self.name.encode()) % num_servers,)
        return tuple(range(num_servers))

    def table_seed(self, seed: int) -> int:
        """Seed of this table's initial values: independent of sharding and of the other tables."""
        return (seed * 1_000_003 + zlib.crc32(self.name.encode())) % (2**63)


@dataclasses.dataclass(kw_only=True, slots=True, frozen=True)
class CacheConfig:
    """A trainer's cache of one table's rows (``ps.cache.<table>``; design: ``docs/cache.md``).

    Give exactly one capacity. Rows a batch in flight needs (the pipeline's lookahead) are never
    evicted; beyond them the ``policy`` chooses. The trainer's own pushes update its cached rows
    with the servers' arithmetic and are written through to the servers.
    """

    capacity_rows: int | None = None
    """Rows the cache holds at most (at most the table's rows are ever held)."""
    capacity_bytes: int | None = None
    """Bytes the cache may take: rows, their optimizer state and the bookkeeping per row of the
    table (what ``distopt.ps.take_fetch_counts().cache_bytes`` reports)."""
    policy: CachePolicy = "lru"
    """Which unpinned row makes room: least recently used (``lru``) or least frequently used
    over the run (``lfu``, which also admits a new row only over a row used no more often)."""
    consistency: Consistency = "exact"
    """``exact``: a cached row is served only when the server proves it current (its version),
    so a run is bitwise equal to one without the cache. ``staleness``: served while it missed at
    most ``staleness`` updates of other trainers (counted with the same versions, and logged)."""
    staleness: int = 0
    """Updates of other trainers a served row may have missed (``consistency: staleness``)."""

    def __post_init__(self) -> None:
        for key in ("capacity_rows", "capacity_bytes"):
            value = getattr(self, key)
            check(
                value is None or (_is_int(value) and value >= 1),
                key,
                "an integer >= 1, or null",
                value,
            )
        check(
            (self.capacity_rows is None) != (self.capacity_bytes is None),
            "capacity_rows",
            "exactly one of capacity_rows and capacity_bytes",
            {"capacity_rows": self.capacity_rows, "capacity_bytes": self.capacity_bytes},
        )
        check(self.policy in ("lru", "lfu"), "policy", "'lru' or 'lfu'", self.policy)
        check(
            self.consistency in ("exact", "staleness"),
            "consistency",
            "'exact' or 'staleness'",
            self.consistency,
        )
        if self.consistency == "exact":
            check(self.staleness == 0, "staleness", "0 with consistency: exact", self.staleness)
        else:
            check(
                _is_int(self.staleness) and self.staleness >= 1,
                "staleness",
                "an integer >= 1 with consistency: staleness",
                self.staleness,
            )

    @property
    def bound(self) -> int:
        """Updates of other trainers a served row may have missed (0: exact)."""
        return self.staleness


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclasses.dataclass(kw_only=True, slots=True, frozen=True)
class ServerOptions:
    """How the parameter-server processes of one job run."""

    backend: str = "rpc"
    """Transport and host of the servers: ``rpc`` (server processes in a ``torch.distributed.rpc``
    group, TensorPipe) or ``ray`` (one Ray actor per server, :mod:`distopt.ps.cluster.ray_backend`). Same
    client API, ordering, errors and checkpoint files on both."""
    num_servers: int = 1
    """Number of server processes (``ps0 .. ps{n-1}``)."""
    seed: int = 0
    """Seed of every table's initial values: two jobs with the same seed start from equal tables."""
    latency_ms: float = 0.0
    """Sleep this long on the server before answering each fetch/push. Emulates network and server
    latency for benchmarks on one machine; 0 in production."""
    host: str = "127.0.0.1"
    """Address the RPC group's store listens on, for :func:`distopt.ps.start_servers` (which starts
    every server on its own host). Loopback by default: nothing is reachable off-host. A
    ``distopt.train`` job takes the launcher's ``MASTER_ADDR`` instead."""
    interface: str = "auto"
    """Network interface TensorPipe and gloo bind to (``TP_SOCKET_IFNAME``/``GLOO_SOCKET_IFNAME``,
    which win when set). ``auto``: the interface of each process's route toward the RPC group's
    host, ``lo`` when that is loopback (:mod:`distopt.dist.netif`). A name is checked on each host: one
    that does not exist there, or loopback toward another host, is a one-line error."""
    num_worker_threads: int = 64
    """Handler threads per server (RPC thread pool; a Ray actor's ``max_concurrency``);
    concurrent requests beyond this queue."""
    ray_address: str = "local"
    """``ray`` backend: the Ray cluster to start actors on when this process has not called
    ``ray.init`` yet, as ``ray.init(address=...)`` takes it: ``HOST:PORT`` of its GCS, ``auto``
    (``$RAY_ADDRESS``, else the cluster started on this machine), or ``local``: a private instance
    on ``host``, shut down with the servers (in a ``distopt.train`` job trainer 0 starts it and the
    other trainers join it, so all trainers must share that host). A cluster that does not answer
    within ``start_timeout_s`` is a one-line error naming this key."""
    ray_namespace: str = "distopt-ps"
    """``ray`` backend: Ray namespace of the named server actors ``ps0 ..``."""
    max_restarts: int = 0
    """``ray`` backend: how often Ray restarts a dead server actor (-1: always). A restarted actor
    reloads its shards from the job's last checkpoint (the last :func:`distopt.ps.save_servers` or
    :func:`~distopt.ps.load_servers`; the seeded tables when there was none, said in a log line) and
    refuses fetches and pushes until a trainer calls :func:`distopt.ps.recover`, which reloads every
    server from that checkpoint (a ``distopt.train`` job does so itself, every trainer rolling back
    with it, at most ``max_restarts`` times: :mod:`distopt.training.recovery`). 0 (default): calls to a
    dead actor keep failing."""
    ray_state_dir: str | None = None
    """``ray`` backend: directory where the job records which checkpoint it saved or loaded last
    (``<ray namespace>.last-checkpoint.json``), read by a restarted actor. It must be on a filesystem
    every actor's node shares with the trainers, as the checkpoints themselves. ``None``: the
    system's temporary directory, which only the launcher's host sees (a single-node Ray)."""
    ray_num_cpus: float = 1.0
    """``ray`` backend: logical CPUs each server actor reserves (its ``num_cpus`` and its bundle in
    the job's placement group; fractions allowed). 1, Ray's own default for scheduling an actor."""
    ray_memory_mb: int = 0
    """``ray`` backend: memory each server actor reserves in MB (Ray's ``memory``); 0: none."""
    ray_placement: PlacementStrategy = "PACK"
    """``ray`` backend: strategy of the job's placement group, one bundle per server actor
    (``PACK``: as few nodes as possible; ``SPREAD``: one node each where possible; ``STRICT_*``:
    exactly so, or the job does not start)."""
    ray_resources: dict[str, float] = dataclasses.field(default_factory=dict)
    """``ray`` backend: further Ray resources each server actor reserves (Ray's ``resources``),
    e.g. a custom resource the nodes meant for servers were started with (``ray start
    --resources``), or ``{"node:10.0.0.2": 0.01}``: the resource Ray gives every node under its
    address, which puts the actors on that node. Empty: CPUs and memory only."""
    transports: tuple[str, ...] = ("uv",)
    """TensorPipe transports, in preference order. ``uv`` (TCP, event-driven) by default: ``shm``
    dedicates a busy-polling reactor thread per process, which steals a whole core from the
    trainer's compute on hosts with few cores (measured: a 0.75 ms tower forward took 25-55 ms
    on 2 cores with ``shm``). Add ``"shm"`` first on many-core hosts where latency matters more."""
    channels: tuple[str, ...] | None = None
    """TensorPipe channels (how tensor payloads travel), in preference order; ``None``: every
    channel the build has, which between processes of one machine includes ``cma`` (one process
    reads the other's memory: no bytes cross the network, even between network namespaces).
    ``["basic"]`` sends every payload over the transport, e.g. through a shaped link."""
    command_prefix: tuple[str, ...] = ()
    """``rpc`` backend: the command each server process that :func:`distopt.ps.start_servers`
    spawns runs under (``ip netns exec NS``, ``taskset -c 1``, ``numactl ...``); empty: none."""
    rpc_timeout_s: float = 30.0
    """Deadline of every fetch/push: a dead or stuck server raises at the wait after this long."""
    start_timeout_s: float = 120.0
    """A trainer's deadline for the servers to start: the RPC group to form, or the Ray actors to
    answer (and, on Ray, to reach the cluster and to place the actors); an unreachable server or
    cluster raises after this. Starting a server means a new process importing torch: measured on
    a loaded 2-core host (load average 7-17), one or two Ray actors answered 8-38 s after they were
    created, past the 30 s this used to be."""
    join_timeout_s: float = 600.0
    """How long servers wait for every trainer to join (servers usually start first)."""
    trainer_timeout_s: float = 60.0
    """A server exits with an error naming the trainer when a trainer that has not finished sends
    nothing (trainers send a heartbeat every ``trainer_timeout_s / 5``) for this long: a killed or
    stuck trainer never keeps the servers up forever."""
    cache: dict[str, CacheConfig] = dataclasses.field(default_factory=dict)
    """Trainer-side row caches by table name (:class:`CacheConfig`; none by default). Checked
    against the model's tables and the host's memory before anything starts."""

    def __post_init__(self) -> None:
        check(self.backend in BACKENDS, "ps.backend", "one of " + ", ".join(BACKENDS), self.backend)
        check(self.num_servers >= 1, "ps.num_servers", "an integer >= 1", self.num_servers)
        check(self.latency_ms >= 0, "ps.latency_ms", "a number >= 0", self.latency_ms)
        check(bool(self.host), "ps.host", "a host address", self.host)
        check(bool(self.interface), "ps.interface", "'auto' or an interface name", self.interface)
        check(
            self.num_worker_threads >= 1,
            "ps.num_worker_threads",
            "an integer >= 1",
            self.num_worker_threads,
        )
        check(
            bool(self.transports) and set(self.transports) <= {"uv", "shm", "ibv"},
            "ps.transports",
            "a non-empty list of 'uv', 'shm', 'ibv'",
            self.transports,
        )
        check(
            self.channels is None or (bool(self.channels) and set(self.channels) <= set(CHANNELS)),
            "ps.channels",
            "null or a non-empty list of " + ", ".join(map(repr, CHANNELS)),
            self.channels,
        )
        check(
            not self.command_prefix or self.backend == "rpc",
            "ps.command_prefix",
            "no prefix with ps.backend ray (Ray starts its actors itself)",
            self.command_prefix,
        )
        check(self.rpc_timeout_s > 0, "ps.rpc_timeout_s", "a number > 0", self.rpc_timeout_s)
        check(self.start_timeout_s > 0, "ps.start_timeout_s", "a number > 0", self.start_timeout_s)
        check(self.join_timeout_s > 0, "ps.join_timeout_s", "a number > 0", self.join_timeout_s)
        check(
            self.trainer_timeout_s > 0,
            "ps.trainer_timeout_s",
            "a number > 0",
            self.trainer_timeout_s,
        )
        ray_endpoint(self.ray_address)
        check(
            bool(self.ray_namespace), "ps.ray_namespace", "a non-empty string", self.ray_namespace
        )
        check(self.ray_num_cpus > 0, "ps.ray_num_cpus", "a number > 0", self.ray_num_cpus)
        check(self.ray_memory_mb >= 0, "ps.ray_memory_mb", "an integer >= 0", self.ray_memory_mb)
        check(
            self.ray_placement in PLACEMENTS,
            "ps.ray_placement",
            "one of " + ", ".join(PLACEMENTS),
            self.ray_placement,
        )
        for name, amount in self.ray_resources.items():
            check(bool(name), "ps.ray_resources", "resource names that are not empty", name)
            check(amount > 0, f"ps.ray_resources.{name}", "a number > 0", amount)
            check(
                name not in ("CPU", "GPU", "memory"),
                f"ps.ray_resources.{name}",
                "a resource other than CPU, GPU and memory (set ps.ray_num_cpus, ps.ray_memory_mb)",
                amount,
            )
        check(
            self.max_restarts >= -1,
            "ps.max_restarts",
            "an integer >= -1 (-1: forever)",
            self.max_restarts,
        )
        check(
            self.ray_state_dir is None or bool(self.ray_state_dir),
            "ps.ray_state_dir",
            "a directory",
            self.ray_state_dir,
        )
        for table, cache in self.cache.items():
            check(
                isinstance(table, str) and bool(table),
                "ps.cache",
                "table names as keys",
                table,
            )
            check(
                isinstance(cache, CacheConfig),
                f"ps.cache.{table}",
                "a CacheConfig",
                cache,
            )


def ray_endpoint(address: str) -> tuple[str, int] | None:
    """``(host, port)`` of a ``ps.ray_address`` (``HOST:PORT`` or a Ray Client ``ray://HOST:PORT``),
    ``None`` for ``auto`` and ``local`` (Ray resolves those)."""
    if address in ("auto", "local"):
        return None
    host, sep, port = address.removeprefix("ray://").rpartition(":")
    check(
        bool(sep and host.strip("[]")) and port.isdigit() and 0 < int(port) < 65536,
        "ps.ray_address",
        "HOST:PORT, ray://HOST:PORT, 'auto' or 'local'",
        address,
    )
    return host.strip("[]"), int(port)


def check_tables(tables: tuple[TableSpec, ...] | list[TableSpec], num_servers: int) -> None:
    """Reject duplicate table names and placements on servers that do not exist."""
    seen: set[str] = set()
    for spec in tables:
        check(spec.name not in seen, "tables", "unique table names", spec.name)
        seen.add(spec.name)
        spec.placement(num_servers)
