"""Bring up and tear down a single-host Slurm cluster from Debian's packages, without systemd.

Usage (as root; ``install_packages.sh`` installs the packages)::

    python -m launchers.slurm.cluster up   [--state-dir DIR] [--nodes 4]
    python -m launchers.slurm.cluster down [--state-dir DIR]
    eval "$(python -m launchers.slurm.cluster env)"   # SLURM_CONF for sbatch/sacct/torchx

Daemons, each started into ``DIR`` with its PID recorded there and stopped by that PID:

* ``munged`` as user munge, socket ``DIR/munge/munge.socket.2``;
* ``mariadbd`` as user mysql with ``--skip-networking`` (unix socket only) for accounting;
* ``slurmdbd`` (TorchX's slurm scheduler calls ``sacct``, so accounting must work);
* ``slurmctld``;
* ``--nodes`` virtual nodes ``slurmd -N dnK`` (NodeAddr=127.0.0.1, one port each). Every replica
  of every role is one component of a heterogeneous job and takes a whole node, so the cluster
  needs as many nodes as the largest job has replicas. The node names are added to /etc/hosts
  for 127.0.0.1 so a job can use ``$SLURM_JOB_NODELIST_HET_GROUP_0`` as its master address.

``up`` is idempotent: daemons already running from ``DIR`` are kept. :func:`start` and :func:`stop`
are the same cluster on any hosts (``launchers.multihost`` runs each daemon in a namespace).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from launchers._proc import port_open, read_pid, stop_pids, tail
from launchers.slurm.config import (
    CLUSTER_NAME,
    Host,
    Layout,
    add_hosts,
    daemon_ports,
    local_hosts,
    remove_hosts,
    write_configs,
)

DEFAULT_STATE_DIR = Path(os.environ.get("DISTOPT_SLURM_STATE_DIR", "/tmp/distopt-slurm"))
REQUIRED = ("munged", "mariadbd", "mariadb-install-db", "slurmdbd", "slurmctld", "slurmd",
            "sbatch", "sacct", "sacctmgr", "sinfo", "setpriv")  # fmt: skip


class SlurmClusterError(RuntimeError):
    """A Slurm daemon could not be started; the message holds the tail of its log."""


@dataclass(frozen=True, slots=True)
class SlurmCluster:
    """A running local Slurm cluster."""

    state_dir: str
    """Directory of configs, logs, PID files and daemon state."""
    slurm_conf: str
    """Path of slurm.conf: export it as ``SLURM_CONF`` for sbatch, sacct, sinfo and torchx."""
    nodes: tuple[str, ...]
    """Names of the nodes (on a single host, each resolves to 127.0.0.1)."""

    def env(self) -> dict[str, str]:
        """Environment for Slurm clients (merge into ``os.environ`` for subprocesses)."""
        return {"SLURM_CONF": self.slurm_conf}


def missing_packages() -> list[str]:
    """The Slurm/munge/MariaDB programs that are not installed."""
    extra = ("/usr/sbin",)  # daemons live in sbin, which a non-login PATH may lack
    path = os.pathsep.join([os.environ.get("PATH", ""), *extra])
    return [prog for prog in REQUIRED if shutil.which(prog, path=path) is None]


def _which(prog: str) -> str:
    return shutil.which(prog, path=f"{os.environ.get('PATH', '')}:/usr/sbin:/usr/bin") or prog


def running(state_dir: Path = DEFAULT_STATE_DIR) -> SlurmCluster | None:
    """The cluster recorded in ``state_dir`` if all its daemons are alive."""
    lay = Layout(Path(state_dir))
    try:
        data = json.loads((lay.root / "cluster.json").read_text())
    except (OSError, ValueError):
        return None
    cluster = SlurmCluster(data["state_dir"], data["slurm_conf"], tuple(data["nodes"]))
    daemons = [
        "munged",
        "mariadbd",
        "slurmdbd",
        "slurmctld",
        *(f"slurmd-{n}" for n in cluster.nodes),
    ]
    return cluster if all(read_pid(lay.pid(d)) for d in daemons) else None


def up(
    state_dir: Path = DEFAULT_STATE_DIR, *, nodes: int = 4, timeout_s: float = 60.0
) -> SlurmCluster:
    """Start every daemon not already running from ``state_dir`` and wait until nodes are idle."""
    check_packages()
    lay = Layout(Path(state_dir))
    existing = running(lay.root)
    if existing is not None and len(existing.nodes) >= nodes:
        return existing
    names = tuple(f"dn{i}" for i in range(1, nodes + 1))
    add_hosts(names)
    controller, hosts = local_hosts(names)
    return start(lay, controller, hosts, timeout_s=timeout_s)


def check_packages() -> None:
    """Raise :class:`SlurmClusterError` naming the missing Slurm/munge/MariaDB programs."""
    missing = missing_packages()
    if missing:
        raise SlurmClusterError(
            f"missing programs: {', '.join(missing)} (run launchers/slurm/install_packages.sh)"
        )


def start(
    lay: Layout,
    controller: Host,
    nodes: Sequence[Host],
    *,
    timeout_s: float = 60.0,
    bind_any: bool = False,
) -> SlurmCluster:
    """Start the daemons of ``lay`` not already running: munged, MariaDB, slurmdbd and slurmctld
    on ``controller``, a slurmd on each of ``nodes``; wait until every node is idle.
    ``bind_any``: see :func:`~launchers.slurm.config.write_configs`."""
    for sub in ("pids", "logs", "etc", "state", "spool"):
        (lay.root / sub).mkdir(parents=True, exist_ok=True)
    lay.root.chmod(0o755)  # munge and mysql users must traverse it
    ports = daemon_ports(lay, [n.name for n in nodes])
    write_configs(lay, controller, nodes, ports, bind_any=bind_any)
    env = dict(os.environ, SLURM_CONF=str(lay.slurm_conf), MYSQL_UNIX_PORT=str(lay.db_socket))

    def port_up(port: int, host: Host = controller) -> Callable[[], bool]:
        return functools.partial(port_open, port, host.addr)

    _start_munged(lay, controller)
    _start_mariadb(lay, controller)
    dbd = [_which("slurmdbd"), "-D"]
    _start(lay, "slurmdbd", dbd, env, ready=port_up(ports["dbd"]), run=controller.run)
    _sacctmgr(["add", "cluster", CLUSTER_NAME], env, ok_if="already exists")
    ctld = [_which("slurmctld"), "-D", "-i", "-f", str(lay.slurm_conf)]
    _start(lay, "slurmctld", ctld, env, ready=port_up(ports["ctld"]), run=controller.run)
    for node in nodes:
        (lay.root / "spool" / node.name).mkdir(exist_ok=True)
        slurmd = [_which("slurmd"), "-D", "-N", node.name, "-f", str(lay.slurm_conf)]
        ready = port_up(ports[node.name], node)
        _start(lay, f"slurmd-{node.name}", slurmd, env, ready=ready, run=node.run)
    cluster = SlurmCluster(str(lay.root), str(lay.slurm_conf), tuple(n.name for n in nodes))
    _wait_idle(cluster, env, timeout_s)
    (lay.root / "cluster.json").write_text(json.dumps(asdict(cluster)))
    return cluster


def down(state_dir: Path = DEFAULT_STATE_DIR) -> list[str]:
    """Stop the daemons recorded in ``state_dir`` and drop the node names from /etc/hosts."""
    stopped = stop(Layout(Path(state_dir)))
    remove_hosts()
    return stopped


def stop(lay: Layout) -> list[str]:
    """Stop the daemons recorded in ``lay`` (reverse start order); returns their names."""
    pid_dir = lay.root / "pids"
    stopped = []
    order = ["slurmd-", "slurmctld", "slurmdbd", "mariadbd", "munged"]
    files = sorted(pid_dir.glob("*.pid")) if pid_dir.is_dir() else []
    for prefix in order:
        for path in [f for f in files if f.stem.startswith(prefix)]:
            pid = read_pid(path)
            if pid is not None:
                stop_pids([pid], grace_s=15.0)
                stopped.append(path.stem)
            path.unlink(missing_ok=True)
    (lay.root / "cluster.json").unlink(missing_ok=True)
    return stopped


# --- daemons -----------------------------------------------------------------------------------


def _start(
    lay: Layout,
    name: str,
    cmd: list[str],
    env: dict[str, str],
    *,
    ready: Callable[[], bool],
    user: str | None = None,
    run: Sequence[str] = (),
) -> int:
    """Start ``cmd`` in its own session unless ``name`` already runs; wait until ``ready()``.

    ``run`` is the argv prefix of the host it runs on (see :class:`Host`).
    """
    pid = read_pid(lay.pid(name))
    if pid is not None:
        return pid
    if user is not None:  # setpriv execs, so the recorded PID is the daemon's own
        cmd = [_which("setpriv"), f"--reuid={user}", f"--regid={user}", "--init-groups", *cmd]
    cmd = [*run, *cmd]
    log = lay.log(name)
    with open(log, "ab") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True, cwd=lay.root)  # fmt: skip
    lay.pid(name).write_text(str(proc.pid))
    deadline = time.monotonic() + 30
    while not ready():
        if proc.poll() is not None or time.monotonic() > deadline:
            stop_pids([proc.pid])
            lay.pid(name).unlink(missing_ok=True)
            state = (
                f"exited with code {proc.returncode}"
                if proc.returncode is not None
                else "did not become ready in 30s"
            )
            raise SlurmClusterError(f"{name} {state}; last lines of {log}:\n{tail(log)}")
        time.sleep(0.2)
    return proc.pid


def _start_munged(lay: Layout, host: Host) -> None:
    if _socket_up(lay.munge_socket) and read_pid(lay.pid("munged")) is None:
        return  # another munged (the system's, or another state dir's) serves the same key
    for path in (lay.munge_dir, lay.munge_socket.parent):
        path.mkdir(parents=True, exist_ok=True)
        shutil.chown(path, "munge", "munge")
        path.chmod(0o755)
    cmd = [
        _which("munged"), "--foreground", f"--socket={lay.munge_socket}",
        f"--pid-file={lay.munge_dir / 'munged.pid'}", f"--log-file={lay.munge_dir / 'munged.log'}",
        f"--seed-file={lay.munge_dir / 'munged.seed'}", "--key-file=/etc/munge/munge.key",
    ]  # fmt: skip
    ready = lay.munge_socket.exists
    _start(lay, "munged", cmd, dict(os.environ), user="munge", ready=ready, run=host.run)


def _start_mariadb(lay: Layout, host: Host) -> None:
    if read_pid(lay.pid("mariadbd")) is not None:
        return
    if not (lay.db_dir / "mysql").is_dir():
        lay.db_dir.mkdir(exist_ok=True)
        shutil.chown(lay.db_dir, "mysql", "mysql")
        cmd = [_which("mariadb-install-db"), "--user=mysql", f"--datadir={lay.db_dir}",
               "--auth-root-authentication-method=socket", "--skip-test-db"]  # fmt: skip
        out = subprocess.run(cmd, capture_output=True, text=True)
        if out.returncode != 0:
            raise SlurmClusterError(
                f"mariadb-install-db failed: {(out.stderr or out.stdout).strip().splitlines()[-1:]}"
            )
    run_dir = lay.db_socket.parent  # mariadbd (user mysql) creates its socket and PID file here
    run_dir.mkdir(exist_ok=True)
    shutil.chown(run_dir, "mysql", "mysql")
    cmd = [
        _which("mariadbd"), "--no-defaults", "--user=mysql", f"--datadir={lay.db_dir}",
        f"--socket={lay.db_socket}", "--skip-networking", f"--pid-file={run_dir / 'mysqld.pid'}",
        "--innodb-buffer-pool-size=32M", "--performance-schema=OFF",
    ]  # fmt: skip
    ready = functools.partial(_socket_up, lay.db_socket)
    _start(lay, "mariadbd", cmd, dict(os.environ), ready=ready, run=host.run)


def _sacctmgr(args: list[str], env: dict[str, str], *, ok_if: str) -> None:
    out = subprocess.run([_which("sacctmgr"), "-i", *args], capture_output=True, text=True, env=env)
    text = (out.stdout + out.stderr).strip()
    if out.returncode != 0 and ok_if not in text:
        raise SlurmClusterError(
            f"sacctmgr {' '.join(args)} failed: {text.splitlines()[-1:] or out.returncode}"
        )


def _wait_idle(cluster: SlurmCluster, env: dict[str, str], timeout_s: float) -> None:
    """Wait until every node reports idle (slurmctld has heard from each slurmd)."""
    deadline = time.monotonic() + timeout_s
    states: dict[str, str] = {}
    while time.monotonic() < deadline:
        out = subprocess.run(
            [_which("sinfo"), "-h", "-N", "-o", "%N %t"], capture_output=True, text=True, env=env
        )
        states = dict(line.split() for line in out.stdout.splitlines() if line.strip())
        if all(states.get(n, "").startswith("idle") for n in cluster.nodes):
            return
        down_nodes = [n for n in cluster.nodes if states.get(n, "").startswith(("down", "drain"))]
        for node in down_nodes:  # a restarted slurmd comes back "down"; it is healthy again
            subprocess.run([_which("scontrol"), "update", f"NodeName={node}", "State=RESUME"],
                           capture_output=True, env=env)  # fmt: skip
        time.sleep(0.5)
    lay = Layout(Path(cluster.state_dir))
    raise SlurmClusterError(
        f"nodes not idle after {timeout_s}s: {states}; last lines of slurmctld log:\n{tail(lay.log('slurmctld-file'))}"
    )


def _socket_up(path: Path) -> bool:
    if not path.exists():
        return False
    with socket.socket(socket.AF_UNIX) as sock:
        sock.settimeout(0.3)
        return sock.connect_ex(str(path)) == 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="launchers.slurm.cluster", description=__doc__.split("\n")[0]
    )
    parser.add_argument("action", choices=["up", "down", "status", "env"])
    parser.add_argument("--state-dir", type=Path, default=DEFAULT_STATE_DIR)
    parser.add_argument("--nodes", type=int, default=4)
    args = parser.parse_args(argv)
    if args.action == "up":
        try:
            cluster = up(args.state_dir, nodes=args.nodes)
        except SlurmClusterError as err:
            print(f"error: {err}", file=sys.stderr)
            return 1
        print(f"slurm up: nodes {','.join(cluster.nodes)}; state in {cluster.state_dir}")
        print(f"export SLURM_CONF={cluster.slurm_conf}")
    elif args.action == "down":
        stopped = down(args.state_dir)
        print(
            f"slurm down: stopped {', '.join(stopped)}" if stopped else "no slurm daemons running"
        )
    elif args.action == "env":
        print(f"export SLURM_CONF={Layout(args.state_dir).slurm_conf}")
    else:
        cluster = running(args.state_dir)
        print(json.dumps(asdict(cluster)) if cluster else "not running")
        return 0 if cluster else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
