"""Start and stop a local Ray head bound to 127.0.0.1.

Usage::

    python -m launchers.ray.cluster start [--state-dir DIR] [--dashboard-port 8265] [--num-cpus 4]
    python -m launchers.ray.cluster stop  [--state-dir DIR]
    python -m launchers.ray.cluster status [--state-dir DIR]

``start`` runs ``ray start --head --block`` in its own session, so every Ray process (GCS, raylet,
dashboard, workers and the job processes they spawn) shares one session id; ``stop`` terminates
exactly those processes by PID. ``ray stop`` is not used: it matches processes by name and would
also stop any other Ray cluster on the machine.

``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` together with ``--node-ip-address=127.0.0.1`` keeps every
listener on loopback; without the variable Ray switches to the host's external address.

:func:`start` also starts a head on another address and :func:`join` a worker node that joins it,
each behind an argv prefix that runs it on another host (``launchers.multihost``: a namespace).
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import os
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from launchers._proc import alive, free_port, read_pid, session_members, stop_pids, tail

DEFAULT_STATE_DIR = Path(os.environ.get("DISTOPT_RAY_STATE_DIR", "/tmp/distopt-ray"))
START_TIMEOUT_S = 90.0


class RayClusterError(RuntimeError):
    """The local Ray head could not be started or reached."""


@dataclass(frozen=True, slots=True)
class RayCluster:
    """A running local Ray head."""

    pid: int
    """PID of the blocking ``ray start`` process (the session leader)."""
    dashboard_address: str
    """``HOST:PORT`` of the dashboard / job submission API (TorchX ``dashboard_address``)."""
    gcs_address: str
    """``HOST:PORT`` of the GCS (``ray.init(address=...)``)."""
    state_dir: str
    """Directory holding the PID file, the cluster record and Ray's temp dir."""


def _ray_bin() -> str:
    # The ray CLI sits next to this interpreter in a venv; fall back to PATH.
    candidate = Path(sys.executable).with_name("ray")
    return str(candidate) if candidate.exists() else "ray"


def _record_path(state_dir: Path) -> Path:
    return state_dir / "cluster.json"


def running(state_dir: Path = DEFAULT_STATE_DIR) -> RayCluster | None:
    """The cluster recorded in ``state_dir`` if its head process is still alive."""
    try:
        data = json.loads(_record_path(state_dir).read_text())
    except (OSError, ValueError):
        return None
    cluster = RayCluster(**data)
    # The record is written only once the head was ready; a live head PID means it still is
    # (`ray start --block` exits when one of its daemons dies).
    return cluster if alive(cluster.pid) else None


def _dashboard_up(address: str) -> bool:
    try:
        with urllib.request.urlopen(f"http://{address}/api/version", timeout=2) as resp:
            return resp.status == 200
    except OSError:
        return False


def start(
    state_dir: Path = DEFAULT_STATE_DIR,
    *,
    dashboard_port: int | None = None,
    num_cpus: int = 4,
    attempts: int = 2,
    node_ip: str = "127.0.0.1",
    run: Sequence[str] = (),
    object_store_mb: int | None = None,
) -> RayCluster:
    """Start a Ray head on ``node_ip`` (or return the one already running in ``state_dir``).

    ``num_cpus`` is Ray's logical CPU count: each replica reserves at least one logical CPU, so a
    parameter-server job with 1 PS and 2 trainers needs 3 even on a 2-core machine. On a loaded
    machine ``ray start`` may give up waiting for its raylet (a fixed 30 s), so it is retried.
    ``run`` is the argv prefix that puts the head on the host owning ``node_ip``.
    """
    state_dir = Path(state_dir)
    existing = running(state_dir)
    if existing is not None:
        return existing
    for attempt in range(1, attempts + 1):
        try:
            return _start_once(
                state_dir, dashboard_port, num_cpus, node_ip, tuple(run), object_store_mb
            )
        except RayClusterError:
            if attempt == attempts:
                raise
    raise AssertionError("unreachable")


def _start_once(
    state_dir: Path,
    dashboard_port: int | None,
    num_cpus: int,
    node_ip: str,
    run: tuple[str, ...],
    object_store_mb: int | None,
) -> RayCluster:
    stop(state_dir)  # clear leftovers of a head that died
    dash_port = dashboard_port or free_port()
    gcs_port = free_port()
    ports = {
        "--port": gcs_port,
        "--dashboard-port": dash_port,
        "--ray-client-server-port": free_port(),
        "--dashboard-agent-listen-port": free_port(),
        "--dashboard-agent-grpc-port": free_port(),
        "--runtime-env-agent-port": free_port(),
        "--metrics-export-port": free_port(),
        "--node-manager-port": free_port(),
        "--object-manager-port": free_port(),
    }
    args = ["--head", f"--dashboard-host={node_ip}", "--include-dashboard=true"]
    proc, log = _launch(state_dir, args, ports, num_cpus, node_ip, run, object_store_mb)
    cluster = RayCluster(
        pid=proc.pid,
        dashboard_address=f"{node_ip}:{dash_port}",
        gcs_address=f"{node_ip}:{gcs_port}",
        state_dir=str(state_dir),
    )
    deadline = time.monotonic() + START_TIMEOUT_S
    while not (_started(log) and _dashboard_up(cluster.dashboard_address)):
        if proc.poll() is not None or time.monotonic() > deadline:
            stop(state_dir)
            why = "exited" if proc.returncode is not None else f"not up after {START_TIMEOUT_S}s"
            raise RayClusterError(f"ray head {why}; last lines of {log}:\n{tail(log)}")
        time.sleep(0.5)
    _wait_for_job_agent(cluster, deadline)
    _record_path(state_dir).write_text(json.dumps(asdict(cluster)))
    return cluster


def join(
    state_dir: Path,
    *,
    gcs_address: str,
    node_ip: str,
    num_cpus: int = 2,
    run: Sequence[str] = (),
    object_store_mb: int | None = None,
) -> int:
    """Start a worker node on ``node_ip`` that joins the head at ``gcs_address``.

    Returns the PID of its ``ray start --block`` (the session leader, stopped by :func:`stop`
    with ``state_dir``); an already running one in ``state_dir`` is kept.
    """
    state_dir = Path(state_dir)
    pid = read_pid(state_dir / "ray.pid")
    if pid is not None:
        return pid
    stop(state_dir)
    ports = {
        "--node-manager-port": free_port(),
        "--object-manager-port": free_port(),
        "--dashboard-agent-listen-port": free_port(),
        "--dashboard-agent-grpc-port": free_port(),
        "--runtime-env-agent-port": free_port(),
        "--metrics-export-port": free_port(),
    }
    args = [f"--address={gcs_address}"]
    proc, log = _launch(state_dir, args, ports, num_cpus, node_ip, tuple(run), object_store_mb)
    deadline = time.monotonic() + START_TIMEOUT_S
    while not _started(log):
        if proc.poll() is not None or time.monotonic() > deadline:
            stop(state_dir)
            why = "exited" if proc.returncode is not None else f"not up after {START_TIMEOUT_S}s"
            raise RayClusterError(
                f"ray worker node {node_ip} {why}; last lines of {log}:\n{tail(log)}"
            )
        time.sleep(0.5)
    return proc.pid


def _launch(
    state_dir: Path,
    args: list[str],
    ports: dict[str, int],
    num_cpus: int,
    node_ip: str,
    run: tuple[str, ...],
    object_store_mb: int | None,
) -> tuple[subprocess.Popen[bytes], Path]:
    """Run ``ray start --block ARGS`` in a session of its own; returns it and its log."""
    state_dir.mkdir(parents=True, exist_ok=True)
    # Ray's unix socket paths must stay under ~107 bytes, so its temp dir is kept short.
    temp_dir = state_dir / "r"
    cmd = [*run, _ray_bin(), "start", "--block", "--disable-usage-stats", *args]
    cmd += [f"--num-cpus={num_cpus}", f"--node-ip-address={node_ip}", f"--temp-dir={temp_dir}"]
    cmd += [f"{flag}={port}" for flag, port in ports.items()]
    if object_store_mb is not None:
        cmd.append(f"--object-store-memory={object_store_mb * 1024 * 1024}")
    env = dict(os.environ)
    if ipaddress.ip_address(node_ip).is_loopback:
        # Declares the cluster single-node (Ray's switch for Windows and macOS), which keeps a
        # loopback node there; Ray then refuses worker nodes, so only a loopback head sets it.
        env["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    # Ray >= 2.5x turns token auth on for a new cluster whenever ~/.ray/auth_token exists (any
    # earlier ray.init() writes one), and the dashboard then answers 401 to TorchX's unauthenticated
    # job client. These nodes listen on 127.0.0.1 or on a namespace bridge of this machine only;
    # an explicit RAY_AUTH_MODE still wins.
    env.setdefault("RAY_AUTH_MODE", "disabled")
    # Workers (the parameter-server actors among them) at the head's priority, not Ray's default
    # niceness 15: trainers run at 0 and would wait on starved servers on a busy host.
    env.setdefault("RAY_worker_niceness", "0")
    # Job entrypoints ("python ...") resolve through the head's PATH: put this venv first.
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    log = state_dir / "ray-start.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    (state_dir / "ray.pid").write_text(str(proc.pid))
    return proc, log


def _started(log: Path) -> bool:
    """``ray start`` prints this once the raylet has registered with the GCS."""
    try:
        return "Ray runtime started" in log.read_text(errors="replace")
    except OSError:
        return False


def _wait_for_job_agent(cluster: RayCluster, deadline: float) -> None:
    """Submit a no-op job until the dashboard accepts it.

    The dashboard answers before its job agent has registered; a submission in that window
    fails with "No available agent to submit job", so readiness is tested with a real one.
    """
    from ray.job_submission import JobStatus, JobSubmissionClient

    client = JobSubmissionClient(f"http://{cluster.dashboard_address}")
    job_id = None
    while job_id is None:
        try:
            job_id = client.submit_job(
                entrypoint="true", submission_id=f"distopt-ready-{uuid.uuid4().hex[:8]}"
            )
        except RuntimeError as err:
            if time.monotonic() > deadline:
                raise RayClusterError(f"ray job agent not ready: {err}") from None
            time.sleep(0.5)
    while client.get_job_status(job_id) not in (
        JobStatus.SUCCEEDED,
        JobStatus.FAILED,
        JobStatus.STOPPED,
    ):
        if time.monotonic() > deadline:
            raise RayClusterError(f"ray readiness job {job_id} did not finish")
        time.sleep(0.3)


def stop(state_dir: Path = DEFAULT_STATE_DIR) -> list[int]:
    """Stop every process of the head recorded in ``state_dir``; returns the PIDs signalled."""
    state_dir = Path(state_dir)
    pid = read_pid(state_dir / "ray.pid")
    stopped: list[int] = []
    if pid is not None:
        # The session holds the head, its daemons, workers and the job processes they spawned.
        members = session_members(os.getsid(pid))
        stopped = [p for p in members if alive(p)]
        stop_pids([pid], grace_s=15.0)  # `ray start --block` tears its own daemons down first
        stop_pids([p for p in members if p != pid], grace_s=5.0)
    for name in ("ray.pid", "cluster.json"):
        (state_dir / name).unlink(missing_ok=True)
    return stopped


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="launchers.ray.cluster", description=__doc__.split("\n")[0]
    )
    parser.add_argument("action", choices=["start", "stop", "status"])
    parser.add_argument("--state-dir", type=Path, default=DEFAULT_STATE_DIR)
    # 8265 matches .torchxconfig's [ray] dashboard_address; tests pass a free port instead.
    parser.add_argument("--dashboard-port", type=int, default=8265)
    parser.add_argument("--num-cpus", type=int, default=4)
    args = parser.parse_args(argv)
    if args.action == "start":
        try:
            cluster = start(
                args.state_dir, dashboard_port=args.dashboard_port, num_cpus=args.num_cpus
            )
        except RayClusterError as err:
            print(f"error: {err}", file=sys.stderr)
            return 1
        print(f"ray head up: dashboard_address={cluster.dashboard_address} pid={cluster.pid}")
        print(
            f"submit with: torchx run -s ray -cfg dashboard_address={cluster.dashboard_address} ..."
        )
    elif args.action == "stop":
        pids = stop(args.state_dir)
        print(f"ray head stopped ({len(pids)} processes)" if pids else "no ray head running")
    else:
        cluster = running(args.state_dir)
        print(json.dumps(asdict(cluster)) if cluster else "not running")
        return 0 if cluster else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
