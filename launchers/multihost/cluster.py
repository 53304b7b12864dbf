"""Bring up and tear down a multi-host cluster on this machine, hosts made of network namespaces.

One Slurm controller and a ``slurmd`` per node, a Ray head and a Ray worker node, each on a host of
its own.

Usage (as root; ``launchers/slurm/install_packages.sh`` installs Slurm, munge, MariaDB and
iproute2)::

    python -m launchers.multihost.cluster [--state-dir DIR] ACTION ...
        up [--nodes 2] [--no-slurm] [--no-ray]     # start (idempotent)
        status                                      # hosts, addresses, Ray addresses (JSON)
        env                                         # export SLURM_CONF=... (eval it)
        exec node1 -- hostname                      # run a command on a host
        shape node1 --rate-mbit 100 [--burst-kib K] [--latency-ms M]   # tc tbf, both ways
        unshape node1
        link node1 down|up                          # pull / plug node1's cable
        down                                        # stop everything, remove everything

Hosts (see :mod:`distopt.dist.netns`): ``ctl`` runs munged, MariaDB, slurmdbd and
slurmctld; ``node0`` .. ``node{N-1}`` each run a slurmd (``NodeAddr`` its own address); the Ray head
runs on ``node0`` and a Ray worker node on every other node. This machine's root namespace is the
login host on the bridge: ``sbatch``, ``sacct`` and Ray job submission run there as they would on a
login node, and reach the cluster over the bridge. munged has a socket of its own in ``DIR``
(``AuthInfo=socket=``), so this cluster shares nothing with the single-host one.

Every process is recorded by PID in ``DIR`` and stopped by that PID; ``down`` then stops by PID
whatever still runs in the cluster's namespaces (job steps, Ray workers), deletes the namespaces,
interfaces and ``/etc/netns`` files, and removes what it wrote to ``DIR``. ``up`` is idempotent.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from distopt.dist import netns
from distopt.dist.netns import LinkShape, Network, NetworkError
from distopt.errors import ConfigError
from launchers._proc import read_pid, stop_pids
from launchers.ray import cluster as ray_cluster
from launchers.slurm import cluster as slurm_cluster
from launchers.slurm.config import Host, Layout

DEFAULT_STATE_DIR = Path(os.environ.get("DISTOPT_MULTIHOST_STATE_DIR", "/tmp/distopt-multihost"))
CONTROLLER = "ctl"
RAY_CPUS_PER_NODE = 2
RAY_OBJECT_STORE_MB = 256
"""Each Ray node's object store; Ray's default (30% of memory per node) adds up on one machine."""
_CREATED = ("network.json", "cluster.json", "slurm", "ray")


class MultiHostError(RuntimeError):
    """The cluster could not be started; one line saying what and why."""


@dataclass(frozen=True, slots=True)
class MultiHostCluster:
    """A running multi-host cluster; plain data, recorded in its state directory."""

    state_dir: str
    network: Network
    nodes: tuple[str, ...]
    """The compute nodes (``node0`` ..), each a host of :attr:`network`."""
    slurm_conf: str | None
    """slurm.conf (export it as ``SLURM_CONF``); ``None`` when started without Slurm."""
    ray_gcs_address: str | None
    """``ADDR:PORT`` of the Ray head's GCS on ``node0``; ``None`` when started without Ray."""
    ray_dashboard_address: str | None
    """``ADDR:PORT`` of the head's dashboard and job API, reachable from the login host."""

    def addr(self, host: str) -> str:
        """The address of ``host`` (a node or ``ctl``) on the cluster network."""
        return self.network.host(host).addr

    def run(self, host: str) -> list[str]:
        """The argv prefix that runs a command on ``host``."""
        return self.network.run(host)

    def env(self) -> dict[str, str]:
        """Environment for Slurm clients on the login host."""
        return {"SLURM_CONF": self.slurm_conf} if self.slurm_conf else {}

    def free_port(self, host: str) -> int:
        """A port free on ``host`` right now (bound and released there, as :func:`free_port`)."""
        code = "import socket; s = socket.socket(); s.bind(('', 0)); print(s.getsockname()[1])"
        out = subprocess.run(
            [*self.run(host), sys.executable, "-c", code], capture_output=True, text=True
        )
        if out.returncode != 0:
            raise MultiHostError(f"no free port on {host}: {out.stderr.strip()}")
        return int(out.stdout)

    def to_json(self) -> str:
        data = asdict(self)
        data["network"] = json.loads(self.network.to_json())
        return json.dumps(data, indent=1)

    @classmethod
    def from_json(cls, text: str) -> MultiHostCluster:
        data = json.loads(text)
        data["network"] = Network.from_json(json.dumps(data["network"]))
        data["nodes"] = tuple(data["nodes"])
        return cls(**data)


def _slurm_layout(state_dir: Path) -> Layout:
    root = state_dir / "slurm"
    return Layout(root, munge_socket=root / "munge" / "munge.socket.2")


def _ray_dir(state_dir: Path, node: str) -> Path:
    return state_dir / "ray" / node


def _recorded_network(state_dir: Path) -> Network | None:
    try:
        return Network.from_json((state_dir / "network.json").read_text())
    except (OSError, ValueError, KeyError, TypeError):
        return None


def running(state_dir: Path = DEFAULT_STATE_DIR) -> MultiHostCluster | None:
    """The cluster recorded in ``state_dir`` if its network and every daemon are alive."""
    state_dir = Path(state_dir)
    try:
        cluster = MultiHostCluster.from_json((state_dir / "cluster.json").read_text())
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if not netns.exists(cluster.network):
        return None
    if cluster.slurm_conf and slurm_cluster.running(_slurm_layout(state_dir).root) is None:
        return None
    if cluster.ray_gcs_address:
        if ray_cluster.running(_ray_dir(state_dir, cluster.nodes[0])) is None:
            return None
        workers = [_ray_dir(state_dir, n) / "ray.pid" for n in cluster.nodes[1:]]
        if not all(read_pid(path) for path in workers):
            return None
    return cluster


def up(
    state_dir: Path = DEFAULT_STATE_DIR,
    *,
    nodes: int = 2,
    slurm: bool = True,
    ray: bool = True,
    timeout_s: float = 90.0,
) -> MultiHostCluster:
    """Start what of the cluster is not running yet and wait until every part answers."""
    state_dir = Path(state_dir)
    why = netns.rights_missing()
    if why is not None:
        raise MultiHostError(why)
    if slurm:
        slurm_cluster.check_packages()
    if nodes < 1 or (ray and nodes < 2):
        raise MultiHostError(f"--nodes: expected at least {2 if ray else 1}, got {nodes}")
    names = tuple(f"node{i}" for i in range(nodes))
    existing = running(state_dir)
    if existing is not None:
        wanted = (names, slurm, ray)
        have = (existing.nodes, bool(existing.slurm_conf), bool(existing.ray_gcs_address))
        if have == wanted:
            return existing
        raise MultiHostError(
            f"a cluster with nodes {','.join(existing.nodes)} (slurm={have[1]}, ray={have[2]}) "
            f"runs from {state_dir}; run down first"
        )
    try:
        return _up(state_dir, names, slurm=slurm, ray=ray, timeout_s=timeout_s)
    except BaseException:
        down(state_dir)  # a failed or interrupted `up` leaves nothing behind
        raise


def _up(
    state_dir: Path, names: tuple[str, ...], *, slurm: bool, ray: bool, timeout_s: float
) -> MultiHostCluster:
    state_dir.mkdir(parents=True, exist_ok=True)
    net = _recorded_network(state_dir)
    if net is None or tuple(h.name for h in net.hosts) != (CONTROLLER, *names):
        if net is not None:  # a different size: tear the old one down first
            down(state_dir)
        net = netns.plan(netns.prefix_for(state_dir), (CONTROLLER, *names))
    # Recorded before anything exists, so `down` removes what a failed `up` left behind.
    (state_dir / "network.json").write_text(net.to_json())
    netns.create(net)
    netns.verify(net, timeout_s=10.0)

    # Slurm and Ray start side by side: most of either's start-up is waiting on its daemons.
    with ThreadPoolExecutor(max_workers=2) as pool:
        slurm_started = (
            pool.submit(_start_slurm, state_dir, net, names, timeout_s) if slurm else None
        )
        ray_started = pool.submit(_start_ray, state_dir, net, names, timeout_s) if ray else None
        slurm_conf = slurm_started.result() if slurm_started else None
        gcs, dashboard = ray_started.result() if ray_started else (None, None)
    cluster = MultiHostCluster(str(state_dir), net, names, slurm_conf, gcs, dashboard)
    (state_dir / "cluster.json").write_text(cluster.to_json())
    return cluster


def _start_slurm(state_dir: Path, net: Network, names: tuple[str, ...], timeout_s: float) -> str:
    def slurm_host(name: str) -> Host:
        return Host(name, net.host(name).addr, name, tuple(net.run(name)))

    lay = _slurm_layout(state_dir)
    lay.root.mkdir(parents=True, exist_ok=True)
    controller = slurm_host(CONTROLLER)
    hosts = [slurm_host(n) for n in names]
    # bind_any: this machine (the login host) has a host name that resolves to 127.0.0.1, where
    # srun would listen for its tasks' output if Slurm bound host names only.
    started = slurm_cluster.start(lay, controller, hosts, timeout_s=timeout_s, bind_any=True)
    return started.slurm_conf


def _start_ray(
    state_dir: Path, net: Network, names: tuple[str, ...], timeout_s: float
) -> tuple[str, str]:
    head_node, *workers = names
    size = {"num_cpus": RAY_CPUS_PER_NODE, "object_store_mb": RAY_OBJECT_STORE_MB}
    head_ip = net.host(head_node).addr
    head_dir = _ray_dir(state_dir, head_node)
    head = ray_cluster.start(head_dir, node_ip=head_ip, run=net.run(head_node), **size)
    for name in workers:
        node_dir, node_ip = _ray_dir(state_dir, name), net.host(name).addr
        ray_cluster.join(
            node_dir, gcs_address=head.gcs_address, node_ip=node_ip, run=net.run(name), **size
        )
    _wait_ray_nodes(head.dashboard_address, [net.host(n).addr for n in names], timeout_s)
    return head.gcs_address, head.dashboard_address


def _wait_ray_nodes(dashboard: str, addrs: list[str], timeout_s: float) -> None:
    """Wait until the head lists a live node on each of ``addrs``."""
    from ray.util.state import list_nodes

    deadline = time.monotonic() + timeout_s
    alive: set[str] = set()
    while time.monotonic() < deadline:
        try:
            nodes = list_nodes(address=f"http://{dashboard}", raise_on_missing_output=False)
        except Exception:  # the state API answers errors while the head settles
            nodes = []
        alive = {n.node_ip for n in nodes if n.state == "ALIVE"}
        if alive >= set(addrs):
            return
        time.sleep(0.5)
    missing = sorted(set(addrs) - alive)
    raise MultiHostError(
        f"ray nodes {', '.join(missing)} not alive at {dashboard} after {timeout_s}s"
    )


def down(state_dir: Path = DEFAULT_STATE_DIR) -> list[str]:
    """Stop everything the cluster in ``state_dir`` runs and remove everything it created."""
    state_dir = Path(state_dir)
    stopped: list[str] = []
    ray_root = state_dir / "ray"
    node_dirs = sorted(ray_root.iterdir(), reverse=True) if ray_root.is_dir() else []
    for node_dir in node_dirs:  # workers before the head (node0 sorts last)
        if ray_cluster.stop(node_dir):
            stopped.append(f"ray@{node_dir.name}")
    stopped += slurm_cluster.stop(_slurm_layout(state_dir))
    net = _recorded_network(state_dir)
    if net is not None:
        # Job steps, Ray workers, anything else started on the hosts: every one of them runs in
        # one of this cluster's namespaces, so `ip netns pids` finds them all.
        for host, pids in netns.processes(net).items():
            stop_pids(pids, grace_s=5.0)
            stopped.append(f"{len(pids)} processes on {host}")
        stopped += netns.destroy(net)
    for name in _CREATED:
        path = state_dir / name
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
    try:
        state_dir.rmdir()  # unless something else (a test fixture's lock) lives there
    except OSError:
        pass
    return stopped


def _network(state_dir: Path) -> Network:
    """The network recorded in ``state_dir`` if it exists (its daemons may be down)."""
    net = _recorded_network(state_dir)
    if net is None or not netns.exists(net):
        raise MultiHostError(f"no multi-host cluster in {state_dir} (run up first)")
    return net


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="launchers.multihost.cluster", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--state-dir", type=Path, default=DEFAULT_STATE_DIR)
    sub = parser.add_subparsers(dest="action", required=True)
    start = sub.add_parser("up", help="start the cluster (idempotent)")
    start.add_argument("--nodes", type=int, default=2)
    start.add_argument("--no-slurm", dest="slurm", action="store_false")
    start.add_argument("--no-ray", dest="ray", action="store_false")
    sub.add_parser("down", help="stop every process and remove everything up created")
    sub.add_parser("status", help="print the running cluster as JSON")
    sub.add_parser("env", help="print export lines for Slurm clients")
    run = sub.add_parser("exec", help="run a command on a host: exec NODE -- CMD ...")
    run.add_argument("host")
    run.add_argument("command", nargs=argparse.REMAINDER)
    shape = sub.add_parser("shape", help="limit both directions of a host's link (tc tbf)")
    shape.add_argument("host")
    shape.add_argument("--rate-mbit", type=float, required=True)
    shape.add_argument("--burst-kib", type=float, default=None)
    shape.add_argument("--latency-ms", type=float, default=50.0)
    unshape = sub.add_parser("unshape", help="remove a host's link limit")
    unshape.add_argument("host")
    link = sub.add_parser("link", help="take a host's link down or bring it up")
    link.add_argument("host")
    link.add_argument("state", choices=["up", "down"])
    # Options before or after the action: `--state-dir` is accepted in both places.
    for p in sub.choices.values():
        p.add_argument("--state-dir", type=Path, default=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    errors = (
        MultiHostError,
        NetworkError,
        slurm_cluster.SlurmClusterError,
        ray_cluster.RayClusterError,
        KeyError,
        ValueError,
    )
    try:
        return _act(args)
    except errors as err:
        message = err.args[0] if isinstance(err, KeyError) else str(err)
        print(f"error: {message}", file=sys.stderr)
        return 1


def _act(args: Any) -> int:
    state_dir: Path = args.state_dir
    if args.action == "up":
        cluster = up(state_dir, nodes=args.nodes, slurm=args.slurm, ray=args.ray)
        hosts = ", ".join(f"{h.name}={h.addr}" for h in cluster.network.hosts)
        print(f"multihost up: {hosts}; state in {cluster.state_dir}")
        if cluster.slurm_conf:
            print(f"export SLURM_CONF={cluster.slurm_conf}")
        if cluster.ray_dashboard_address:
            print(f"ray: gcs {cluster.ray_gcs_address}, dashboard {cluster.ray_dashboard_address}")
    elif args.action == "down":
        stopped = down(state_dir)
        print(f"multihost down: {', '.join(stopped)}" if stopped else "no multihost cluster")
    elif args.action == "status":
        found = running(state_dir)
        print(found.to_json() if found else "not running")
        return 0 if found else 1
    elif args.action == "env":
        print(f"export SLURM_CONF={_slurm_layout(state_dir).slurm_conf}")
    elif args.action == "exec":
        command = args.command[1:] if args.command[:1] == ["--"] else args.command
        if not command:
            raise MultiHostError("exec: no command given (exec NODE -- CMD ...)")
        argv = [*_network(state_dir).run(args.host), *command]
        os.execvp(argv[0], argv)
    elif args.action == "shape":
        try:
            spec = LinkShape(
                rate_mbit=args.rate_mbit, burst_kib=args.burst_kib, latency_ms=args.latency_ms
            )
        except ConfigError as err:
            raise MultiHostError(f"link shape {err}") from None
        netns.shape_host(_network(state_dir), args.host, spec)
        print(f"{args.host}: {' '.join(spec.tbf_args())} both ways")
    elif args.action == "unshape":
        netns.unshape_host(_network(state_dir), args.host)
    else:
        netns.set_link(_network(state_dir), args.host, up=args.state == "up")
    return 0


if __name__ == "__main__":
    sys.exit(main())
