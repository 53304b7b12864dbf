"""Integration: the hosts of the multi-host cluster (``launchers.multihost``), without its daemons.

Each host is a network namespace. These tests check what makes it a host: its own name and address,
names that resolve the same on every host, a loopback no other host reaches, a link that ``shape``
limits and ``link down`` cuts; and that ``up`` is idempotent and ``down`` leaves nothing behind.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from distopt.dist.netns import LinkShape
from launchers._proc import alive
from tests.launchers.conftest import REPO, require_namespaces

pytestmark = [pytest.mark.slow, pytest.mark.cluster]

RATE_MBIT = 40.0
PAYLOAD_BYTES = 5_000_000  # 1 s at RATE_MBIT


def cli(state: Path, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """``python -m launchers.multihost.cluster --state-dir STATE ARGS``, as a user runs it."""
    cmd = [sys.executable, "-m", "launchers.multihost.cluster", "--state-dir", str(state), *args]
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout)


def on(cluster: Any, host: str, code: str, *args: str, timeout: float = 30) -> Any:
    """Run Python ``code`` on ``host``; returns the JSON it prints."""
    cmd = [*cluster.run(host), sys.executable, "-c", code, *args]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, f"{host}: {out.stderr[-2000:]}"
    return json.loads(out.stdout)


def start_on(cluster: Any, host: str, code: str, *args: str) -> subprocess.Popen[str]:
    """Start Python ``code`` on ``host``; its stdout is a pipe."""
    cmd = [*cluster.run(host), sys.executable, "-c", code, *args]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stdin=subprocess.PIPE, text=True)


@pytest.fixture(scope="module")
def net_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """Hosts ctl, node0 and node1 on their bridge, no Slurm or Ray (a private one: these tests
    shape and cut links)."""
    require_namespaces()
    from launchers.multihost import cluster as multihost

    state = tmp_path_factory.mktemp("multihost-net")
    cluster = multihost.up(state, nodes=2, slurm=False, ray=False)
    try:
        yield cluster
    finally:
        multihost.down(state)


IDENTITY = """
import json, socket, sys
names = json.loads(sys.argv[1])
with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as udp:
    udp.connect((sys.argv[2], 9))  # toward the login host: picks the address, sends nothing
    addr = udp.getsockname()[0]
print(json.dumps({"hostname": socket.gethostname(), "addr": addr,
                  "resolved": {n: socket.gethostbyname(n) for n in names}}))
"""


def test_each_host_has_its_name_and_address_and_resolves_every_host_alike(net_cluster) -> None:
    hosts = {h.name: h.addr for h in net_cluster.network.hosts}
    for name, addr in hosts.items():
        seen = on(
            net_cluster, name, IDENTITY, json.dumps(sorted(hosts)), net_cluster.network.gateway
        )
        assert seen == {"hostname": name, "addr": addr, "resolved": hosts}, name
    # The machine's own /etc/hosts is not touched (other clusters rewrite it concurrently).
    assert net_cluster.network.subnet.rsplit(".", 1)[0] not in Path("/etc/hosts").read_text()


STORE_CLIENT = """
import json, socket, sys
import torch.distributed as dist
store = dist.TCPStore(sys.argv[1], int(sys.argv[2]), is_master=False)
store.set(socket.gethostname(), "here")
print(json.dumps({"mapped": socket.getnameinfo(("::ffff:" + sys.argv[1], 0), 0)[0]}))
"""


def test_a_store_client_on_a_host_connects_without_a_warning(net_cluster) -> None:
    # c10d names each socket it connects (getnameinfo of an IPv4-mapped IPv6 address); with no
    # DNS on the hosts, a name missing from their /etc/hosts logged a warning per connection.
    import torch.distributed as dist

    gateway = net_cluster.network.gateway
    store = dist.TCPStore(gateway, 0, is_master=True, wait_for_workers=False)
    cmd = [*net_cluster.run("node0"), sys.executable, "-c", STORE_CLIENT, gateway, str(store.port)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stderr == "", out.stderr[-2000:]
    assert json.loads(out.stdout) == {"mapped": "login"}
    assert store.get("node0") == b"here"


LISTEN = """
import json, socket, sys
lo = socket.create_server(("127.0.0.1", 0))
anywhere = socket.create_server(("0.0.0.0", 0))
print(json.dumps([lo.getsockname()[1], anywhere.getsockname()[1]]), flush=True)
sys.stdin.read()  # serve until the test closes stdin
"""

CONNECT = """
import json, socket, sys
results = []
for addr, port in json.loads(sys.argv[1]):
    try:
        socket.create_connection((addr, port), timeout=3).close()
        results.append("connected")
    except OSError as err:
        results.append(type(err).__name__)
print(json.dumps(results))
"""


def test_a_listener_on_loopback_is_unreachable_from_another_host(net_cluster) -> None:
    node0 = net_cluster.addr("node0")
    server = start_on(net_cluster, "node0", LISTEN)
    try:
        assert server.stdout is not None
        lo_port, any_port = json.loads(server.stdout.readline())
        targets = [("127.0.0.1", lo_port), (node0, lo_port), (node0, any_port)]
        from_node0 = on(net_cluster, "node0", CONNECT, json.dumps(targets))
        from_node1 = on(net_cluster, "node1", CONNECT, json.dumps(targets))
    finally:
        server.communicate(timeout=10)
    assert from_node0 == ["connected", "ConnectionRefusedError", "connected"]
    # node1's 127.0.0.1 is node1's own: a store bound to loopback on node0 is out of reach.
    assert from_node1 == ["ConnectionRefusedError", "ConnectionRefusedError", "connected"]


RECEIVE = """
import json, socket, sys, time
server = socket.create_server((sys.argv[1], 0))
print(server.getsockname()[1], flush=True)
conn, _ = server.accept()
first = conn.recv(1 << 16)
start, received = time.monotonic(), len(first)
while chunk := conn.recv(1 << 16):
    received += len(chunk)
print(json.dumps({"bytes": received, "seconds": time.monotonic() - start}), flush=True)
"""

SEND = """
import socket, sys
with socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=30) as conn:
    conn.sendall(b"x" * int(sys.argv[3]))
"""


def throughput_mbit(cluster: Any, src: str, dst: str, nbytes: int = PAYLOAD_BYTES) -> float:
    """Send ``nbytes`` from ``src`` to ``dst`` over TCP; megabits per second as received."""
    receiver = start_on(cluster, dst, RECEIVE, cluster.addr(dst))
    assert receiver.stdout is not None
    port = receiver.stdout.readline().strip()
    on_src = [*cluster.run(src), sys.executable, "-c", SEND, cluster.addr(dst), port, str(nbytes)]
    subprocess.run(on_src, check=True, timeout=60)
    out, _ = receiver.communicate(timeout=60)
    result = json.loads(out)
    assert result["bytes"] == nbytes
    return result["bytes"] * 8 / result["seconds"] / 1e6


def test_shape_limits_both_directions_of_a_hosts_link(net_cluster) -> None:
    state = Path(net_cluster.state_dir)
    shaped = cli(state, "shape", "node1", "--rate-mbit", str(RATE_MBIT))
    assert shaped.returncode == 0, shaped.stderr
    directions = [("node1", "node0"), ("node0", "node1")]
    try:
        limited = [throughput_mbit(net_cluster, src, dst) for src, dst in directions]
    finally:
        unshaped = cli(state, "unshape", "node1")
    assert unshaped.returncode == 0, unshaped.stderr
    free = [throughput_mbit(net_cluster, src, dst) for src, dst in directions]
    print(f"node1 <-> node0 Mbit/s: shaped to {RATE_MBIT}: {limited}; unshaped: {free}")
    for rate in limited:  # the burst (32 KiB) lets a 5 MB transfer exceed the rate by < 1%
        assert 0.5 * RATE_MBIT < rate < 1.1 * RATE_MBIT
    for rate in free:
        assert rate > 5 * RATE_MBIT


def test_shape_rejects_a_bad_rate_and_an_unknown_host_in_one_line(net_cluster) -> None:
    state = Path(net_cluster.state_dir)
    bad_rate = cli(state, "shape", "node1", "--rate-mbit", "-5")
    assert bad_rate.returncode == 1
    assert bad_rate.stderr == "error: link shape rate_mbit: expected a number > 0, got -5.0\n"
    unknown = cli(state, "shape", "node7", "--rate-mbit", "10")
    assert unknown.returncode == 1
    prefix = net_cluster.network.prefix
    assert (
        unknown.stderr == f"error: no host 'node7' in network {prefix} (hosts: ctl, node0, node1)\n"
    )
    with pytest.raises(ValueError, match="burst_kib: expected a number >= 2, got 1"):
        LinkShape(rate_mbit=10, burst_kib=1)


def test_link_down_cuts_a_host_off_and_link_up_restores_it(net_cluster) -> None:
    state = Path(net_cluster.state_dir)
    server = start_on(net_cluster, "node1", LISTEN)
    try:
        assert server.stdout is not None
        _, port = json.loads(server.stdout.readline())
        target = json.dumps([(net_cluster.addr("node1"), port)])
        assert cli(state, "link", "node1", "down").returncode == 0
        try:
            # No carrier: the connection times out or the host is unreachable (OSError).
            assert on(net_cluster, "node0", CONNECT, target) in (["TimeoutError"], ["OSError"])
        finally:
            assert cli(state, "link", "node1", "up").returncode == 0
        deadline = time.monotonic() + 10  # the bridge port forwards again within a moment
        while (result := on(net_cluster, "node0", CONNECT, target)) != ["connected"]:
            assert time.monotonic() < deadline, result
            time.sleep(0.2)
    finally:
        server.communicate(timeout=10)


def _leftovers(prefix: str) -> dict[str, list[str]]:
    netns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    etc = Path("/etc/netns")
    names = [line.split()[0] for line in netns.splitlines() if line.strip()]
    links_names = [line.split()[1].split("@")[0].rstrip(":") for line in links.splitlines()]
    return {
        "netns": sorted(n for n in names if n.startswith(f"{prefix}-")),
        "links": sorted(n for n in links_names if n.startswith(f"{prefix}-")),
        "etc": sorted(p.name for p in etc.glob(f"{prefix}-*")) if etc.is_dir() else [],
    }


def test_up_is_idempotent_and_down_ends_every_process_and_removes_everything(tmp_path) -> None:
    require_namespaces()
    from distopt.dist.netns import prefix_for

    state, hosts_before = tmp_path / "cluster", Path("/etc/hosts").read_text()
    first = cli(state, "up", "--nodes", "1", "--no-slurm", "--no-ray")
    assert first.returncode == 0, first.stderr
    record = (state / "cluster.json").read_text()
    again = cli(state, "up", "--nodes", "1", "--no-slurm", "--no-ray")
    assert again.returncode == 0 and again.stdout == first.stdout, again.stderr
    assert (state / "cluster.json").read_text() == record
    prefix = prefix_for(state)
    created = _leftovers(prefix)
    assert created["netns"] == created["etc"] == [f"{prefix}-ctl", f"{prefix}-node0"]
    assert created["links"] == [f"{prefix}-br", f"{prefix}-ctl", f"{prefix}-node0"]
    # A process on the node that nobody stops: `down` ends it by PID.
    exec_sleep = ["exec", "node0", "--", "sleep", "300"]
    cmd = [sys.executable, "-m", "launchers.multihost.cluster", "--state-dir", str(state)]
    sleeper = subprocess.Popen([*cmd, *exec_sleep], cwd=REPO)
    deadline = time.monotonic() + 30
    while Path(f"/proc/{sleeper.pid}/cmdline").read_bytes().split(b"\0")[0] != b"sleep":
        assert time.monotonic() < deadline and sleeper.poll() is None
        time.sleep(0.1)
    down = cli(state, "down")
    assert down.returncode == 0, down.stderr
    assert "1 processes on node0" in down.stdout
    sleeper.wait(timeout=10)
    assert not alive(sleeper.pid)
    assert _leftovers(prefix) == {"netns": [], "links": [], "etc": []}
    assert not state.exists()
    assert Path("/etc/hosts").read_text() == hosts_before
    assert cli(state, "down").stdout == "no multihost cluster\n"


def test_up_without_the_rights_fails_in_one_line_and_creates_nothing(tmp_path) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root to run the command as another user")
    state = tmp_path / "cluster"
    nobody = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
    cmd = [
        *nobody,
        sys.executable,
        "-m",
        "launchers.multihost.cluster",
        "--state-dir",
        str(state),
        "up",
    ]
    out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 1
    assert out.stderr == (
        "error: creating network namespaces needs root (CAP_SYS_ADMIN and CAP_NET_ADMIN); "
        "running as uid 65534\n"
    )
    assert not state.exists()
