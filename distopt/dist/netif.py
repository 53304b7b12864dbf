"""Which network interface a job's process listens on, chosen from the route to its rendezvous.

gloo and TensorPipe bind their listeners to one interface (``GLOO_SOCKET_IFNAME``,
``TP_SOCKET_IFNAME``); without one, gloo binds the address this host's own name resolves to,
which on many machines is ``127.0.1.1``. The default is ``auto``: the interface that carries this
host's route toward the rendezvous address (``MASTER_ADDR``, the RPC group's host), which is
loopback for a job on one host and the cluster network's interface for a job across hosts. An
interface named explicitly (``--iface``, ``ps.interface``, the environment variables) is checked
on the host where it is used: one that does not exist there, or loopback toward another host, is
one line naming the host, the address and the key to change.

The route is the kernel's own answer: a UDP socket ``connect``-ed toward the address (nothing is
sent) has the source address the kernel would use; the interface is the one holding that address.
"""

from __future__ import annotations

import fcntl
import ipaddress
import os
import socket
import struct
from collections.abc import Iterator, Mapping
from contextlib import contextmanager

from distopt.errors import ConfigError

AUTO = "auto"
"""The interface of this host's route toward the rendezvous address."""
ENV_KEYS = ("GLOO_SOCKET_IFNAME", "TP_SOCKET_IFNAME")
ENV_KEY = "GLOO_SOCKET_IFNAME (--iface)"
"""How errors name the environment variables (a component's ``--iface`` sets both)."""
_SIOCGIFADDR = 0x8915


def from_environ(env: Mapping[str, str] | None = None) -> str | None:
    """The interface the environment names (``GLOO_SOCKET_IFNAME``, else ``TP_SOCKET_IFNAME``)."""
    env = os.environ if env is None else env
    return next((env[k] for k in ENV_KEYS if env.get(k)), None)


def addresses() -> dict[str, list[str]]:
    """This host's interfaces with their addresses (IPv4 primary address, then IPv6 ones)."""
    found: dict[str, list[str]] = {name: [] for _, name in socket.if_nameindex()}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for name in found:
            try:
                request = struct.pack("256s", name.encode()[:15])
                reply = fcntl.ioctl(sock.fileno(), _SIOCGIFADDR, request)
            except OSError:  # no IPv4 address on this interface
                continue
            found[name].append(socket.inet_ntoa(reply[20:24]))
    try:
        with open("/proc/net/if_inet6") as table:
            for line in table:
                fields = line.split()
                addr = ipaddress.IPv6Address(int(fields[0], 16))
                found.setdefault(fields[-1], []).append(str(addr))
    except OSError:  # no IPv6
        pass
    return found


def resolve(host: str, *, address_key: str) -> str:
    """``host``'s address as this host resolves it (a name or an address)."""
    try:
        return str(socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)[0][4][0])
    except OSError as err:
        raise ConfigError(
            f"{hostname()}: {address_key} {host!r} does not resolve on this host: {err.strerror or err}"
        ) from None


def route(host: str, *, address_key: str) -> tuple[str, str]:
    """``(interface, source address)`` of this host's route toward ``host``."""
    addr = resolve(host, address_key=address_key)
    family = socket.AF_INET6 if ":" in addr else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as sock:
            sock.connect((addr, 9))  # picks the route and the source address; sends nothing
            source = sock.getsockname()[0]
    except OSError as err:
        raise ConfigError(
            f"{hostname()}: no route to {address_key} {host} ({addr}) from this host: "
            f"{err.strerror or err}"
        ) from None
    by_address = {a: name for name, addrs in addresses().items() for a in addrs}
    name = by_address.get(source)
    if name is None and ipaddress.ip_address(source).is_loopback:
        name = next((n for n, addrs in addresses().items() if "127.0.0.1" in addrs), None)
    if name is None:
        raise ConfigError(
            f"{hostname()}: no interface holds {source}, this host's address toward "
            f"{address_key} {host} ({addr}); set {ENV_KEY} to the interface to use"
        )
    return name, source


def choose(setting: str, *, toward: str, key: str, address_key: str = "MASTER_ADDR") -> str:
    """The interface to listen on: ``setting`` checked on this host, or for ``auto`` the one of
    the route toward ``toward``; ``key`` is what the user sets to change it."""
    if setting == AUTO:
        return route(toward, address_key=address_key)[0]
    have = addresses()
    if setting not in have:
        raise ConfigError(
            f"{hostname()}: {key}: no interface {setting!r} on this host (it has "
            f"{', '.join(sorted(have))}); set {key} to the interface that reaches {address_key} "
            f"{toward}, or to 'auto'"
        )
    addr = resolve(toward, address_key=address_key)
    carries_loopback = any(ipaddress.ip_address(a).is_loopback for a in have[setting])
    if carries_loopback and not ipaddress.ip_address(addr).is_loopback:
        raise ConfigError(
            f"{hostname()}: {key}: {setting!r} is loopback, which cannot reach {address_key} "
            f"{toward} ({addr}); set {key} to 'auto' or to the interface that reaches it"
        )
    return setting


@contextmanager
def pinned(
    setting: str, *, toward: str, key: str, address_key: str = "MASTER_ADDR"
) -> Iterator[str]:
    """Within the block, gloo and TensorPipe listen only on :func:`choose`'s interface (they read
    the environment when a group is made); yields it.

    The environment is restored after the block: left set, the interface chosen for one group
    would pass as the user's own setting to this process's next group, toward another host, and
    to every process it starts (a benchmark's servers on the far side of a link then bound
    ``lo``)."""
    name = choose(setting, toward=toward, key=key, address_key=address_key)
    before = {env_key: os.environ.get(env_key) for env_key in ENV_KEYS}
    os.environ.update(dict.fromkeys(ENV_KEYS, name))
    try:
        yield name
    finally:
        for env_key, value in before.items():
            if value is None:
                os.environ.pop(env_key, None)
            else:
                os.environ[env_key] = value


def pin_gloo(toward: str) -> str:
    """gloo's interface for a group whose store is at ``toward``: the environment's, checked, else
    the route's (``auto``). TensorPipe's is left as it is."""
    given = os.environ.get("GLOO_SOCKET_IFNAME")
    name = choose(given or AUTO, toward=toward, key=ENV_KEY)
    os.environ["GLOO_SOCKET_IFNAME"] = name
    return name


def check_not_loopback_across_hosts(host: str, *, nodes: int, address_key: str) -> None:
    """A store host named by this host's own name that resolves to loopback, in a job of several
    nodes: the other nodes would reach their own loopback, or nothing, until the start timeout."""
    if nodes <= 1 or host.split(".")[0] != hostname().split(".")[0]:
        return
    addr = resolve(host, address_key=address_key)
    if ipaddress.ip_address(addr).is_loopback:
        raise ConfigError(
            f"{hostname()}: {address_key} {host!r} resolves to {addr} (loopback) on this host, but "
            f"the job spans {nodes} nodes, which cannot reach it there; map {host} to its network "
            f"address in /etc/hosts (or DNS), or set {address_key} to that address"
        )


def job_nodes(env: Mapping[str, str] | None = None) -> int:
    """How many nodes the launcher says the job spans (torchrun's ``GROUP_WORLD_SIZE``, Slurm's
    node lists); 1 when it says nothing."""
    env = os.environ if env is None else env
    counts = [1]
    if env.get("GROUP_WORLD_SIZE", "").isdigit():
        counts.append(int(env["GROUP_WORLD_SIZE"]))
    lists = {v for k, v in env.items() if k.startswith("SLURM_JOB_NODELIST") and v}
    if len(lists) > 1 or any("," in v or "[" in v for v in lists):
        counts.append(2)  # more than one node name (a hostlist range or a list)
    return max(counts)


def hostname() -> str:
    return socket.gethostname()
