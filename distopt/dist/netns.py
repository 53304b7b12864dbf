"""Hosts made of Linux network namespaces on this machine, joined by one bridge.

Used by the multi-host test cluster (``launchers/multihost``: Slurm and Ray across such hosts)
and by benchmarks that need a real, shaped link between trainers and servers
(:func:`host_on_link`: ``distopt bench`` ps_overlap with ``link:``).

Each host ``NAME`` is a network namespace ``PREFIX-NAME`` holding one end of a veth pair
(``eth0`` inside, ``PREFIX-NAME`` outside, a port of the bridge ``PREFIX-br``), its own address in
a /24, its own loopback, and a default route via the bridge's address, which is this machine's root
namespace: the "login host" from which jobs are submitted. Nothing routes between hosts' loopbacks,
so a store bound to 127.0.0.1 on one host is as unreachable from another as on a real cluster.

Names resolve the same on every host: ``ip netns exec`` bind-mounts ``/etc/netns/NETNS/hosts`` over
``/etc/hosts`` (and ``.../hostname`` over ``/etc/hostname``) for the processes it starts, and every
host's file maps every host name to its address (a host's own name to its bridge address, not to
127.0.1.1, which would make whatever binds "its own address" unreachable). Every process is
started in a UTS namespace of its own whose hostname is the host's name, so ``hostname``,
``socket.gethostname()`` and Slurm's node lookup answer as on a real node. The root namespace's
own ``/etc/hosts`` is left alone (other clusters on this machine rewrite it).

What the hosts share — the filesystem, users, PIDs, /dev/shm — a cluster with a shared filesystem
shares too; what they do not share is everything on the network.

Links are shaped with ``tc qdisc ... tbf`` (:func:`shape`); ``netem`` (added delay, loss) is not
available on every kernel, so latency cannot be added, only bandwidth limited.
"""

from __future__ import annotations

import contextlib
import hashlib
import ipaddress
import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from distopt.config import check

__all__ = [
    "Host",
    "LinkShape",
    "Network",
    "NetworkError",
    "create",
    "destroy",
    "exists",
    "host_on_link",
    "link_bytes",
    "plan",
    "prefix_for",
    "processes",
    "rights_missing",
    "set_link",
    "shape",
    "shape_host",
    "unshape",
    "unshape_host",
    "verify",
]

NETNS_ETC = Path("/etc/netns")
RESOLV_CONF = "# no DNS on this cluster: every name is in /etc/hosts\nnameserver 127.0.0.1\n"
"""Each host's resolver: a name or address /etc/hosts lacks fails at once (nothing answers on the
host's own loopback) instead of waiting 10 s on this machine's name server, which no host reaches.
torch's stores look up every peer's IPv4-mapped address (``::ffff:10.x.y.z``), which /etc/hosts
never lists: with the machine's resolver each such lookup took 10 s and logged a warning."""
CGROUP_ROOT = "/sys/fs/cgroup"
INNER_IFNAME = "eth0"
GATEWAY_NAME = "login"
SUBNETS = ipaddress.IPv4Network("10.27.0.0/16")
"""Where host subnets are taken from: the first free /24 after one derived from the prefix."""
_IFNAME_MAX = 15  # IFNAMSIZ - 1


class NetworkError(RuntimeError):
    """A namespace, link or qdisc could not be created; the message names it and says why."""


@dataclass(frozen=True, slots=True)
class Host:
    """One host: a network namespace with one interface on the bridge."""

    name: str
    """Host name inside (``hostname``, /etc/hosts) and suffix of the namespace and outer veth."""
    netns: str
    """Name of the network namespace (``ip netns``)."""
    addr: str
    """The host's address on the bridge."""
    peer: str
    """The veth end in the root namespace (a port of the bridge), shaped for traffic to the host."""
    ifname: str = INNER_IFNAME
    """The host's interface (what ``GLOO_SOCKET_IFNAME``/``TP_SOCKET_IFNAME`` name there)."""


@dataclass(frozen=True, slots=True)
class Network:
    """A set of hosts on one bridge; plain data, written to and read from a state directory."""

    prefix: str
    """Prefix of every namespace and interface name this network owns."""
    bridge: str
    subnet: str
    gateway: str
    """The bridge's address: the root namespace (login host) as the hosts see it."""
    hosts: tuple[Host, ...]

    def host(self, name: str) -> Host:
        for host in self.hosts:
            if host.name == name:
                return host
        known = ", ".join(h.name for h in self.hosts)
        raise KeyError(f"no host {name!r} in network {self.prefix} (hosts: {known})")

    def run(self, name: str) -> list[str]:
        """The argv prefix that runs a command on host ``name``.

        ``ip netns exec`` and ``unshare`` exec (no fork), and so does the shell, so the PID of the
        started process is the command's own and can be recorded and signalled.
        """
        host = self.host(name)
        enter = [_tool("ip"), "netns", "exec", host.netns, _tool("unshare"), "--uts", "--"]
        setup = " ".join(f"{m} 2>/dev/null;" for m in _cgroup_mounts())
        return [*enter, "sh", "-c", f'{setup} hostname "$0" && exec "$@"', host.name]

    def hosts_file(self) -> str:
        """The /etc/hosts every host sees: loopback names, then every host's address."""
        lines = ["127.0.0.1 localhost", "::1 localhost ip6-localhost ip6-loopback"]
        login = {GATEWAY_NAME, os.uname().nodename.split(".")[0]}
        named = [(self.gateway, " ".join(sorted(login))), *((h.addr, h.name) for h in self.hosts)]
        lines += [f"{addr} {names}" for addr, names in named]
        # c10d's sockets are IPv6 ones holding IPv4-mapped addresses, and it names each socket
        # it connects (getnameinfo) for its log: with no DNS here, a mapped address missing from
        # this file printed "The hostname of the client socket cannot be retrieved" per store
        # connection.
        lines += [f"::ffff:{addr} {names}" for addr, names in [("127.0.0.1", "localhost"), *named]]
        return "\n".join(lines) + "\n"

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)

    @classmethod
    def from_json(cls, text: str) -> Network:
        data = json.loads(text)
        hosts = tuple(Host(**h) for h in data.pop("hosts"))
        return cls(**data, hosts=hosts)


@dataclass(frozen=True, kw_only=True, slots=True)
class LinkShape:
    """A token-bucket limit on one direction of a link (``tc qdisc ... tbf``)."""

    rate_mbit: float
    """Sustained rate in megabits (10^6 bit) per second."""
    burst_kib: float | None = None
    """Bucket size in KiB: how much may leave at line rate after an idle spell. ``None``: 4 ms of
    traffic at ``rate_mbit``, at least 32 KiB (a bucket under one timer tick's worth of data
    keeps the link below its rate)."""
    latency_ms: float = 50.0
    """How long a packet may wait in the queue before it is dropped (tbf's queue limit; this is
    not added delay)."""

    def __post_init__(self) -> None:
        check(self.rate_mbit > 0, "rate_mbit", "a number > 0", self.rate_mbit)
        check(
            self.burst_kib is None or self.burst_kib >= 2,
            "burst_kib",
            "a number >= 2",
            self.burst_kib,
        )
        check(self.latency_ms > 0, "latency_ms", "a number > 0", self.latency_ms)

    def tbf_args(self) -> list[str]:
        burst = self.burst_kib
        if burst is None:
            burst = max(32.0, self.rate_mbit * 1e6 / 8 * 0.004 / 1024)
        # tc: "mbit" is 10^6 bit/s, "kb" is KiB.
        rate, latency = f"{self.rate_mbit:g}mbit", f"{self.latency_ms:g}ms"
        return ["tbf", "rate", rate, "burst", f"{burst:g}kb", "latency", latency]


def _cgroup_mounts() -> list[str]:
    """Commands that mount this machine's cgroup hierarchies again, as they are mounted here.

    ``ip netns exec`` mounts a fresh sysfs on /sys (so /sys/class/net lists the namespace's
    interfaces), which hides the cgroup file systems mounted under /sys/fs/cgroup; slurmd will
    not start without them, and Ray and torch read their limits there.
    """
    commands = []
    for line in Path("/proc/self/mounts").read_text().splitlines():
        source, target, fstype, options = line.split()[:4]
        if target == CGROUP_ROOT or target.startswith(f"{CGROUP_ROOT}/"):
            args = ["-t", fstype, "-o", options, source, target]
            commands.append(f"{{ mkdir -p {shlex.quote(target)}; mount {shlex.join(args)}; }}")
    return commands


def prefix_for(state_dir: Path) -> str:
    """A short name prefix owned by one state directory (two clusters never share a name)."""
    digest = hashlib.sha1(str(Path(state_dir).resolve()).encode()).hexdigest()
    return f"dm{digest[:4]}"


def rights_missing() -> str | None:
    """Why this process cannot create network namespaces (one line), or None when it can."""
    tools = [t for t in ("ip", "tc", "unshare") if _which(t) is None]
    if tools:
        return f"{', '.join(tools)} not found (install iproute2 and util-linux)"
    if os.geteuid() != 0:
        return (
            f"creating network namespaces needs root (CAP_SYS_ADMIN and CAP_NET_ADMIN); "
            f"running as uid {os.geteuid()}"
        )
    probe = subprocess.run(
        [_tool("unshare"), "--net", "--uts", "--mount", "true"], capture_output=True, text=True
    )
    if probe.returncode != 0:
        why = (probe.stderr.strip().splitlines() or [f"exit code {probe.returncode}"])[-1]
        return f"cannot create network namespaces here: unshare --net: {why}"
    return None


def plan(prefix: str, names: Sequence[str], *, subnet: str | None = None) -> Network:
    """The network of ``names`` under ``prefix`` (nothing is created)."""
    longest = max((len(n) for n in names), default=0)
    if len(prefix) + 1 + max(longest, 2) > _IFNAME_MAX:
        raise NetworkError(
            f"prefix {prefix!r} and host names up to {longest} characters exceed the "
            f"{_IFNAME_MAX}-character interface name limit"
        )
    if len(set(names)) != len(names) or GATEWAY_NAME in names:
        raise NetworkError(f"host names must be distinct and not {GATEWAY_NAME!r}: {list(names)}")
    net = ipaddress.ip_network(subnet) if subnet else _free_subnet(prefix)
    addrs = list(net.hosts())
    if len(names) + 1 > len(addrs):
        raise NetworkError(f"subnet {net} is too small for {len(names)} hosts")
    # .1 is the gateway; hosts from .2 on, in the order given.
    hosts = tuple(
        Host(name=n, netns=f"{prefix}-{n}", addr=str(addrs[i + 1]), peer=f"{prefix}-{n}")
        for i, n in enumerate(names)
    )
    return Network(
        prefix=prefix, bridge=f"{prefix}-br", subnet=str(net), gateway=str(addrs[0]), hosts=hosts
    )


def _free_subnet(prefix: str) -> ipaddress.IPv4Network:
    """A /24 of :data:`SUBNETS` that no route of the root namespace overlaps."""
    used: list[ipaddress.IPv4Network] = []
    for line in _ip("-4", "route", "show", "table", "all").splitlines():
        word = line.split()[0] if line.split() else ""
        if word in ("local", "broadcast", "unreachable", "blackhole", "prohibit"):
            word = line.split()[1]
        try:
            used.append(ipaddress.IPv4Network(word, strict=False))
        except ValueError:
            continue  # "default", multicast keywords
    subnets = list(SUBNETS.subnets(new_prefix=24))
    start = int(hashlib.sha1(prefix.encode()).hexdigest(), 16) % len(subnets)
    for offset in range(len(subnets)):
        candidate = subnets[(start + offset) % len(subnets)]
        if not any(candidate.overlaps(u) for u in used):
            return candidate
    raise NetworkError(f"no free /24 left in {SUBNETS}")


def exists(net: Network) -> bool:
    """Whether every namespace, interface and hosts file of ``net`` is there (a link taken
    down with :func:`set_link` still is)."""
    namespaces = set(_netns_list())
    if not all(h.netns in namespaces for h in net.hosts):
        return False
    if not _link_exists(net.bridge) or not all(_link_exists(h.peer) for h in net.hosts):
        return False
    return all((NETNS_ETC / h.netns / "hosts").exists() for h in net.hosts)


def create(net: Network) -> None:
    """Create what of ``net`` is missing (idempotent); raises :class:`NetworkError`."""
    why = rights_missing()
    if why is not None:
        raise NetworkError(why)
    if not _link_exists(net.bridge):
        _ip("link", "add", net.bridge, "type", "bridge")
    prefixlen = ipaddress.ip_network(net.subnet).prefixlen
    gateway = f"{net.gateway}/{prefixlen}"
    if gateway not in _ip("-4", "-o", "addr", "show", "dev", net.bridge):
        _ip("addr", "add", gateway, "dev", net.bridge)
    _ip("link", "set", net.bridge, "up")
    namespaces = set(_netns_list())
    for host in net.hosts:
        if host.netns not in namespaces:
            _ip("netns", "add", host.netns)
        if not _link_exists(host.peer):
            inner_end = ["name", host.ifname, "netns", host.netns]
            _ip("link", "add", host.peer, "type", "veth", "peer", *inner_end)
        _ip("link", "set", host.peer, "master", net.bridge)
        _ip("link", "set", host.peer, "up")
        inner = ["-n", host.netns]
        if f" {host.addr}/" not in _ip(*inner, "-4", "-o", "addr", "show", "dev", host.ifname):
            _ip(*inner, "addr", "add", f"{host.addr}/{prefixlen}", "dev", host.ifname)
        _ip(*inner, "link", "set", "lo", "up")
        _ip(*inner, "link", "set", host.ifname, "up")
        _ip(*inner, "route", "replace", "default", "via", net.gateway, "dev", host.ifname)
        etc = NETNS_ETC / host.netns
        etc.mkdir(parents=True, exist_ok=True)
        (etc / "hosts").write_text(net.hosts_file())
        (etc / "hostname").write_text(f"{host.name}\n")
        (etc / "resolv.conf").write_text(RESOLV_CONF)


_VERIFY = """
import json, socket, sys
name, expected, gateway, port, timeout = sys.argv[1:]
problems = []
if socket.gethostname() != name:
    problems.append(f"its hostname is {socket.gethostname()!r}")
for host, addr in json.loads(expected).items():
    try:
        got = socket.gethostbyname(host)
    except OSError as err:
        got = str(err)
    if got != addr:
        problems.append(f"{host} resolves to {got}, not {addr}")
try:
    socket.create_connection((gateway, int(port)), timeout=float(timeout)).close()
except OSError as err:
    problems.append(f"cannot reach the login host {gateway}:{port}: {err}")
print("; ".join(problems))
sys.exit(1 if problems else 0)
"""


def verify(net: Network, *, timeout_s: float = 10.0) -> None:
    """Check from every host that it has its own name, resolves every host's name to that host's
    address, and reaches the login host; raises :class:`NetworkError` naming the host."""
    expected = json.dumps({h.name: h.addr for h in net.hosts})
    with socket.create_server((net.gateway, 0)) as server:
        port = str(server.getsockname()[1])
        for host in net.hosts:
            args = [
                sys.executable,
                "-c",
                _VERIFY,
                host.name,
                expected,
                net.gateway,
                port,
                str(timeout_s),
            ]
            try:
                out = subprocess.run(
                    [*net.run(host.name), *args], capture_output=True, text=True, timeout=timeout_s
                )
            except subprocess.TimeoutExpired:
                raise NetworkError(
                    f"host {host.name} ({host.netns}): no answer in {timeout_s}s"
                ) from None
            if out.returncode != 0:
                why = out.stdout.strip() or out.stderr.strip().splitlines()[-1:]
                raise NetworkError(f"host {host.name} ({host.netns}): {why}")


def processes(net: Network) -> dict[str, list[int]]:
    """PIDs of the processes in each host's namespace (all started through :meth:`Network.run`)."""
    present = set(_netns_list())
    found: dict[str, list[int]] = {}
    for host in net.hosts:
        if host.netns in present:
            pids = [int(p) for p in _ip("netns", "pids", host.netns).split()]
            if pids:
                found[host.name] = pids
    return found


def destroy(net: Network) -> list[str]:
    """Remove the namespaces, interfaces and hosts files of ``net`` that exist; returns their names.

    Stop the processes in the namespaces first (:func:`processes`): a namespace that still holds
    a process lives on, unnamed, after ``ip netns delete``.
    """
    removed = []
    namespaces = set(_netns_list())
    for host in net.hosts:
        if _link_exists(host.peer):  # deleting one end of a veth pair deletes both
            _ip("link", "delete", host.peer)
            removed.append(host.peer)
        if host.netns in namespaces:
            _ip("netns", "delete", host.netns)
            removed.append(f"netns {host.netns}")
        etc = NETNS_ETC / host.netns
        if etc.exists():
            shutil.rmtree(etc)
            removed.append(str(etc))
    if _link_exists(net.bridge):
        _ip("link", "delete", net.bridge)
        removed.append(net.bridge)
    try:
        NETNS_ETC.rmdir()  # only when no other network has hosts files there
    except OSError:
        pass
    return removed


def shape(dev: str, spec: LinkShape, *, netns: str | None = None) -> None:
    """Limit traffic leaving interface ``dev`` (in namespace ``netns``) to ``spec``.

    tbf shapes what an interface sends; to limit both directions of a host's link, shape both
    ends of its veth pair (:func:`shape_host`).
    """
    _tc(netns, "qdisc", "replace", "dev", dev, "root", *spec.tbf_args())


def unshape(dev: str, *, netns: str | None = None) -> None:
    """Give ``dev`` its default queueing discipline back (no error when it was not shaped)."""
    args = ["qdisc", "del", "dev", dev, "root"]
    out = subprocess.run(
        [_tool("tc"), *(["-n", netns] if netns else []), *args], capture_output=True, text=True
    )
    if (
        out.returncode != 0
        and "No such file or directory" not in out.stderr
        and ("Cannot delete qdisc with handle of zero" not in out.stderr)
    ):
        raise NetworkError(f"tc {' '.join(args)}: {out.stderr.strip()}")


def shape_host(net: Network, name: str, spec: LinkShape) -> None:
    """Limit both directions of host ``name``'s link to the bridge to ``spec`` each."""
    host = net.host(name)
    shape(host.ifname, spec, netns=host.netns)  # what the host sends
    shape(host.peer, spec)  # what the host receives


def unshape_host(net: Network, name: str) -> None:
    host = net.host(name)
    unshape(host.ifname, netns=host.netns)
    unshape(host.peer)


def link_bytes(net: Network, name: str) -> tuple[int, int]:
    """``(received, sent)``: bytes host ``name`` has received and sent over its link so far (the
    counters of its veth's outer end, which sends what the host receives)."""
    statistics = Path("/sys/class/net") / net.host(name).peer / "statistics"
    return int((statistics / "tx_bytes").read_text()), int((statistics / "rx_bytes").read_text())


@contextlib.contextmanager
def host_on_link(name: str, spec: LinkShape, *, prefix: str) -> Iterator[Network]:
    """A network of one host ``name`` whose link to this machine (the login host, at the
    network's ``gateway``) is shaped to ``spec`` both ways; everything is stopped and removed on
    exit, a SIGTERM's or SIGINT's too (:func:`_terminate_unwinds`). Raises
    :class:`NetworkError` (one line) where namespaces cannot be made."""
    why = rights_missing()
    if why is not None:
        raise NetworkError(why)
    net = plan(prefix, (name,))
    with _terminate_unwinds():
        try:
            create(net)
            shape_host(net, name, spec)
            yield net
        finally:
            with _signals_ignored():  # a second signal must not leave half of it behind
                for pids in processes(net).values():
                    for pid in pids:
                        with contextlib.suppress(ProcessLookupError):
                            os.kill(pid, signal.SIGKILL)
                destroy(net)


_UNWINDING_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def _in_main_thread() -> bool:
    """Whether signal handlers can be set here (Python runs them in the main thread only)."""
    return threading.current_thread() is threading.main_thread()


def _restore(handlers: dict[signal.Signals, Any]) -> None:
    for sig, handler in handlers.items():
        # None: a handler set outside Python, which Python cannot set back.
        signal.signal(sig, signal.SIG_DFL if handler is None else handler)


@contextlib.contextmanager
def _terminate_unwinds() -> Iterator[None]:
    """While inside, SIGTERM (``kill``, ``timeout``) ends this process as Ctrl-C does: by an
    exception (``SystemExit(128 + SIGTERM)``), so ``finally`` blocks and context managers run
    and stop what they started. By default SIGTERM ends the process at once, and the network
    namespaces, links and ``/etc/netns`` files it made outlive it."""
    if not _in_main_thread():
        yield
        return

    def unwind(signum: int, _frame: object) -> None:
        raise SystemExit(128 + signum)

    previous = {signal.SIGTERM: signal.signal(signal.SIGTERM, unwind)}
    try:
        yield
    finally:
        _restore(previous)


@contextlib.contextmanager
def _signals_ignored() -> Iterator[None]:
    """SIGTERM and SIGINT are ignored while inside (in the main thread)."""
    if not _in_main_thread():
        yield
        return
    previous = {sig: signal.signal(sig, signal.SIG_IGN) for sig in _UNWINDING_SIGNALS}
    try:
        yield
    finally:
        _restore(previous)


def set_link(net: Network, name: str, *, up: bool) -> None:
    """Take host ``name``'s link down or bring it up (a pulled cable; the host's processes live)."""
    host = net.host(name)
    _ip("link", "set", host.peer, "up" if up else "down")


# --- ip / tc ------------------------------------------------------------------------------------


def _which(tool: str) -> str | None:
    return shutil.which(tool, path=f"{os.environ.get('PATH', '')}:/usr/sbin:/sbin")


def _tool(tool: str) -> str:
    return _which(tool) or tool


def _ip(*args: str) -> str:
    out = subprocess.run([_tool("ip"), *args], capture_output=True, text=True)
    if out.returncode != 0:
        raise NetworkError(f"ip {' '.join(args)}: {out.stderr.strip() or out.returncode}")
    return out.stdout


def _tc(netns: str | None, *args: str) -> None:
    cmd = [_tool("tc"), *(["-n", netns] if netns else []), *args]
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        where = f" (netns {netns})" if netns else ""
        raise NetworkError(f"tc {' '.join(args)}{where}: {out.stderr.strip() or out.returncode}")


def _netns_list() -> list[str]:
    return [line.split()[0] for line in _ip("netns", "list").splitlines() if line.strip()]


def _link_exists(dev: str) -> bool:
    out = subprocess.run([_tool("ip"), "link", "show", "dev", dev], capture_output=True)
    return out.returncode == 0
