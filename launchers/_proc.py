"""Process helpers shared by the local cluster scripts: free ports, PID files, stop-by-PID.

Every daemon a cluster script starts is recorded by PID in its state directory and stopped by
that PID (never by process name), so two clusters, or a cluster and a user's own Ray/Slurm, can
share a machine.
"""

from __future__ import annotations

import os
import signal
import socket
import time
from collections.abc import Iterable
from pathlib import Path

__all__ = ["alive", "free_port", "port_open", "read_pid", "session_members", "stop_pids", "tail"]


def free_port(host: str = "127.0.0.1", *, consecutive: int = 1) -> int:
    """:func:`distopt.dist.rendezvous.free_port`, imported when first called: the cluster scripts
    start in a fraction of a second instead of loading torch."""
    from distopt.dist.rendezvous import free_port as rendezvous_free_port

    return rendezvous_free_port(host, consecutive=consecutive)


def port_open(port: int, host: str = "127.0.0.1") -> bool:
    """Whether something accepts TCP connections on ``host:port``."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.settimeout(0.5)
        return sock.connect_ex((host, port)) == 0


def alive(pid: int) -> bool:
    """Whether ``pid`` is a live (non-zombie) process."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie still answers kill(0); /proc says whether it is one
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def read_pid(path: Path) -> int | None:
    """The PID stored in ``path``, or None when the file is missing or stale."""
    try:
        pid = int(path.read_text().strip())
    except (OSError, ValueError):
        return None
    return pid if alive(pid) else None


def session_members(sid: int) -> list[int]:
    """PIDs whose session id is ``sid``: a daemon tree started with ``start_new_session``.

    Children that outlive their parent are re-parented to init but keep the session id, so this
    finds them where walking the parent/child tree would not.
    """
    members = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if os.getsid(int(entry.name)) == sid:
                members.append(int(entry.name))
        except OSError:
            continue
    return members


def stop_pids(pids: Iterable[int], *, grace_s: float = 10.0) -> list[int]:
    """SIGTERM ``pids``, wait up to ``grace_s``, then SIGKILL survivors; returns the killed ones."""
    pending = [pid for pid in pids if alive(pid)]
    for pid in pending:
        _signal(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while pending and time.monotonic() < deadline:
        time.sleep(0.1)
        pending = [pid for pid in pending if alive(pid)]
    for pid in pending:
        _signal(pid, signal.SIGKILL)
    return pending


def _signal(pid: int, sig: signal.Signals) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def tail(path: Path, lines: int = 20) -> str:
    """The last ``lines`` lines of a log file, for error messages."""
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError:
        return f"(no log at {path})"
    return "\n".join(text[-lines:])
