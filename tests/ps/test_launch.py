"""Job start-up and shutdown: loopback-only listeners, clean exits, reuse of a trainer process."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

import distopt.ps as ps
from distopt.ps import stop_servers
from distopt.ps.spec import ServerOptions, TableSpec
from tests.noise import noise

pytestmark = pytest.mark.slow

TABLES = (TableSpec(name="t", num_rows=10, dim=4),)
_LOOPBACK = {"0100007F", "00000000000000000000000001000000"}  # 127.0.0.1 and ::1 in /proc/net


def _listening(pids: list[int]) -> list[str]:
    """``addr:port`` (hex, as in /proc/net/tcp*) of every TCP listener owned by ``pids``."""
    inodes: set[str] = set()
    for pid in pids:
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            target = os.readlink(fd) if fd.is_symlink() else ""
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    found = []
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # 0A = LISTEN
                found.append(fields[1])
    return found


def test_every_listener_of_a_job_is_on_loopback() -> None:
    with ps.local_job(TABLES, ServerOptions(num_servers=2)) as job:
        ps.fetch("t", torch.tensor([1]))
        ps.discard_step()
        listeners = _listening([os.getpid(), *job.pids])
        by_pid = {
            p: [a for a in _listening([p]) if not a.startswith("0100007F")]
            for p in [os.getpid(), *job.pids]
        }
    assert len(listeners) >= 3  # job store + each server's TensorPipe listener(s)
    assert [a for a in listeners if a.split(":")[0] not in _LOOPBACK] == [], by_pid


def test_servers_exit_cleanly_after_the_trainer_shuts_down() -> None:
    with ps.running_servers(TABLES, ServerOptions(num_servers=2)) as job:
        ps.init_trainer(job)
        ps.push_async("t", torch.tensor([1]), torch.ones(1, 4), lr=1.0)  # flushed by shutdown
        ps.shutdown()
        assert stop_servers(job, timeout_s=10) == [0, 0]


def test_a_trainer_process_can_join_consecutive_jobs() -> None:
    for seed in (0, 1):
        with ps.local_job(TABLES, ServerOptions(seed=seed)):
            with torch.no_grad():
                rows = ps.fetch("t")
        assert rows.shape == (10, 4)


_ROUNDS = textwrap.dedent(
    """
    import sys
    import torch
    import distopt.ps as ps
    from distopt.ps.spec import ServerOptions, TableSpec

    for seed in range(int(sys.argv[1])):
        options = ServerOptions(num_servers=2, seed=seed)
        with ps.local_job((TableSpec(name="t", num_rows=10, dim=4),), options) as job:
            for _ in range(5):
                ps.fetch("t", torch.tensor([1, 2])).sum().backward()
                ps.push_gradients(lr=0.1)
        for log in job.logs:
            print(log)
    """
)


@pytest.mark.parametrize("rounds", [1, 2])
def test_local_job_rounds_leave_stderr_and_server_logs_quiet(tmp_path: Path, rounds: int) -> None:
    """A benchmark sweep runs one ``local_job`` per point in one process. From the second on, the
    trainer's agent numbered its shutdown barrier past the fresh servers', the group left without
    it, and every pipe that closed warned (``RPC agent for trainer0 encountered error when reading
    incoming response from ps0: EOF``) on the user's stderr and in the servers' logs."""
    script = tmp_path / "rounds.py"
    script.write_text(_ROUNDS)
    proc = subprocess.run(
        [sys.executable, str(script), str(rounds)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert noise(proc.stderr) == []
    logs = proc.stdout.split()
    assert len(logs) == 2 * rounds
    for log in logs:
        # Also no "RuntimeWarning: 'distopt.ps.cluster.rpc_process' found in sys.modules after
        # import of package ..." from runpy: the servers run distopt.ps.cluster.rpc_main.
        assert noise(Path(log).read_text()) == [], log


_WITHOUT_RAY = textwrap.dedent(
    """
    import sys
    from importlib.util import find_spec
    import torch
    import distopt
    import distopt.ps as ps
    from distopt.ps.cluster.session import backend_for
    from distopt.ps.spec import ServerOptions, TableSpec

    assert "ray" not in sys.modules, "import distopt imported ray"
    assert backend_for(ServerOptions()).name == "rpc"
    assert "ray" not in sys.modules, "the RPC backend imported ray"
    with ps.local_job((TableSpec(name="t", num_rows=10, dim=4),), ServerOptions()):
        ps.fetch("t", torch.tensor([1, 2])).sum().backward()
        ps.push_gradients(lr=0.1)
    assert "ray" not in sys.modules, "an RPC job imported ray"
    if find_spec("ray") is not None:  # distopt[ray]
        assert backend_for(ServerOptions(backend="ray")).name == "ray"
        assert "ray" in sys.modules  # the Ray backend, loaded when a job picks it, imports it
    """
)


def test_distopt_and_an_rpc_job_never_import_ray(tmp_path: Path) -> None:
    """Ray is optional and slow to import: only a job with ``ps.backend: ray`` loads it."""
    script = tmp_path / "without_ray.py"
    script.write_text(_WITHOUT_RAY)
    proc = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-3000:]


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def test_an_idle_job_burns_no_cpu() -> None:
    # A busy-polling transport (TensorPipe's shm) spins a core per process: on a 2-core host it
    # made a 0.75 ms tower forward take 25-55 ms. The default transport must sleep when idle.
    with ps.local_job(TABLES) as job:
        with torch.no_grad():
            ps.fetch("t", torch.tensor([1]))
        pids = [os.getpid(), *job.pids]
        before = [_cpu_seconds(p) for p in pids]
        time.sleep(1.0)
        used = [_cpu_seconds(p) - b for p, b in zip(pids, before, strict=True)]
    assert max(used) < 0.3, f"CPU seconds used in 1 s idle (trainer, servers): {used}"


_RAY_JOB = textwrap.dedent(
    """
    import torch
    import distopt.ps as ps
    from distopt.ps.spec import ServerOptions, TableSpec

    with ps.local_job((TableSpec(name="t", num_rows=10, dim=4),), ServerOptions(backend="ray")):
        ps.fetch("t", torch.tensor([1, 2])).sum().backward()
        ps.push_gradients(lr=0.1)
    """
)


def test_a_local_ray_job_leaves_stderr_empty(tmp_path: Path) -> None:
    # Ray logged "INFO worker.py:... -- Started a local Ray instance." on the user's stderr for
    # every job (ps_overlap with ps.backend=ray: one line per sweep point).
    pytest.importorskip("ray")
    script = tmp_path / "ray_job.py"
    script.write_text(_RAY_JOB)
    proc = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=180,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stderr == ""
