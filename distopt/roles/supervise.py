"""Run a training job's processes on this host and restart the job when one of them fails.

``python -m distopt.roles.supervise --config configs/jobs/ps_dlrm_tiny.yaml --num-ps 2 --num-trainers 2
--max-restarts 3 [--set key=value ...]`` starts ``ps0..`` and ``trainer0..`` as
``python -m distopt.train`` with the environment of the TorchX ``ps_job`` component (without servers:
the trainers of a DDP/FSDP job). When any process exits with an error, the others get ``--grace-s``
to notice and exit on their own (trainers raise within ``ps.rpc_timeout_s`` naming the server,
servers exit within ``ps.trainer_timeout_s`` naming a silent trainer); whatever is left is killed by
PID. Then the whole job starts again on fresh ports with ``resume=true``, so it continues from the
newest complete checkpoint.

Why a whole-job restart: the processes of a job share one RPC group (and one gloo group), and
``torch.distributed.rpc`` cannot re-admit a replaced member, so one lost process means a new group.
Why here and not in TorchX: torchx 0.7.0's ``local_cwd`` scheduler ignores ``max_retries`` (only
Kubernetes, AWS/GCP Batch, Docker and Slurm act on it; Slurm requeues the whole job), and
``torchrun --max-restarts`` restarts one role's worker group, never the servers. On those
schedulers, pass ``--set resume=true`` and a fixed ``--run_id`` and their retries resume the same way.

Every attempt's process logs go to ``<output_dir>/<run_id>/logs/attempt<k>/<name>.log``; events
(start, exit, kill, restart, done) with wall-clock times to ``<output_dir>/<run_id>/supervisor.jsonl``.
Exit status: 0 when an attempt succeeds, 1 when the restarts are used up, 2 on a configuration error.
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import json
import os
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, TextIO

from distopt.config import load_config
from distopt.dist.rendezvous import free_port
from distopt.errors import ConfigError, DistoptError
from distopt.training.checkpoint import latest_complete
from distopt.training.config import JobConfig, add_job_arguments, add_process_arguments

_JOB_ENV = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "DISTOPT_ROLE",
    "DISTOPT_NUM_PS",
    "DISTOPT_NUM_TRAINERS",
    "REPLICA_ID",
    "DISTOPT_REPLICA_ID",
    "DISTOPT_PS_ADDR",
    "DISTOPT_DDP_PORT",
    "TORCHELASTIC_USE_AGENT_STORE",
)


@dataclasses.dataclass(kw_only=True, slots=True, frozen=True)
class SuperviseOptions:
    """How the supervisor runs one job."""

    config: str
    """Job config path (``distopt.train --config``)."""
    overrides: tuple[str, ...] = ()
    """``--set key=value`` overrides of every attempt."""
    num_ps: int = 1
    """Parameter-server processes (0: a trainers-only DDP/FSDP job)."""
    num_trainers: int = 1
    max_restarts: int = 3
    """Restarts after failures; the job fails when one more attempt fails."""
    grace_s: float = 30.0
    """After the first failure, how long the other processes get to exit on their own."""
    host: str = "127.0.0.1"
    """Address the job's rendezvous stores and RPC listen on (loopback: nothing off-host)."""
    iface: str = "lo"
    """Network interface of gloo and TensorPipe (``GLOO_SOCKET_IFNAME``/``TP_SOCKET_IFNAME``)."""
    run_id: str | None = None
    """Run id of every attempt (default: the config's, else a new one)."""

    def __post_init__(self) -> None:
        if self.num_ps < 0:
            raise ConfigError(f"--num-ps: expected an integer >= 0, got {self.num_ps}")
        if self.num_trainers < 1:
            raise ConfigError(f"--num-trainers: expected an integer >= 1, got {self.num_trainers}")
        if self.max_restarts < 0:
            raise ConfigError(f"--max-restarts: expected an integer >= 0, got {self.max_restarts}")
        if self.grace_s < 0:
            raise ConfigError(f"--grace-s: expected a number >= 0, got {self.grace_s}")


def _die_with_parent() -> None:
    """In the child before exec: get SIGKILL when the supervisor dies (Linux), so a killed
    supervisor never leaves a job behind."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _last_line(path: Path) -> str:
    try:
        lines = [ln for ln in path.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return ""
    # Prefer the exception line of a traceback over torch's shutdown warnings after it.
    errors = [ln for ln in lines if "Error:" in ln or "error:" in ln]
    return (errors or lines or [""])[-1].strip()


class Supervisor:
    """Starts, watches and restarts the processes of one job (see the module docstring)."""

    def __init__(self, options: SuperviseOptions, config: JobConfig, *, out: TextIO) -> None:
        self.options = options
        self.config = config
        self.out = out
        self.run_id = (
            options.run_id
            or config.run_id
            or f"sup-{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(3)}"
        )
        self.run_dir = Path(config.output_dir) / self.run_id
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.events = self.run_dir / "supervisor.jsonl"
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.logs: dict[str, Path] = {}

    def event(self, kind: str, **fields: Any) -> None:
        record = {"event": kind, "time": time.time(), **fields}
        with open(self.events, "a") as stream:
            stream.write(json.dumps(record) + "\n")

    def say(self, text: str) -> None:
        print(f"[supervise] {text}", file=self.out, flush=True)

    def _env(self, attempt: int) -> dict[str, str]:
        host = self.options.host
        env = {k: v for k, v in os.environ.items() if k not in _JOB_ENV}
        env.update(
            DISTOPT_RUN_ID=self.run_id,
            DISTOPT_NUM_PS=str(self.options.num_ps),
            DISTOPT_NUM_TRAINERS=str(self.options.num_trainers),
            DISTOPT_ATTEMPT=str(attempt),
            MASTER_ADDR=host,
            MASTER_PORT=str(free_port(host)),
        )
        if self.options.iface:
            env.update(GLOO_SOCKET_IFNAME=self.options.iface, TP_SOCKET_IFNAME=self.options.iface)
        if self.options.num_ps:
            env.update(
                DISTOPT_PS_ADDR=f"{host}:{env['MASTER_PORT']}",
                DISTOPT_DDP_PORT=str(free_port(host)),
            )
        else:
            env["WORLD_SIZE"] = str(self.options.num_trainers)
        return env

    def start(self, attempt: int) -> None:
        """Start every process of attempt ``attempt`` (resuming after the first)."""
        env = self._env(attempt)
        overrides = [*self.options.overrides, f"run_id={self.run_id}"]
        if attempt > 0:
            overrides.append("resume=true")
        cmd = [sys.executable, "-m", "distopt.train", "--config", self.options.config]
        cmd += [arg for item in overrides for arg in ("--set", item)]
        log_dir = self.run_dir / "logs" / f"attempt{attempt}"
        log_dir.mkdir(parents=True, exist_ok=True)
        members = [("ps", i) for i in range(self.options.num_ps)]
        members += [("trainer", i) for i in range(self.options.num_trainers)]
        for role, index in members:
            name = f"{role}{index}"
            proc_env = {**env, "DISTOPT_ROLE": role, "REPLICA_ID": str(index)}
            if not self.options.num_ps:
                proc_env.update(RANK=str(index), LOCAL_RANK=str(index))
            self.logs[name] = log_dir / f"{name}.log"
            with open(self.logs[name], "wb") as log:
                proc = subprocess.Popen(
                    cmd,
                    env=proc_env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    preexec_fn=_die_with_parent,
                )
            self.procs[name] = proc
            self.event("start", attempt=attempt, process=name, pid=proc.pid)
        pids = ", ".join(f"{n} {p.pid}" for n, p in self.procs.items())
        self.say(f"attempt {attempt}: started {pids}")

    def kill_all(self) -> list[str]:
        """SIGKILL every process still running, by PID; returns their names."""
        killed = []
        for name, proc in self.procs.items():
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait()
                killed.append(name)
        return killed

    def watch(self, attempt: int) -> bool:
        """Wait for attempt ``attempt`` to end; True when every process exited with 0."""
        started = time.monotonic()
        exited: dict[str, int] = {}
        first_failure: float | None = None
        while len(exited) < len(self.procs):
            for name, proc in self.procs.items():
                code = proc.poll()
                if code is None or name in exited:
                    continue
                exited[name] = code
                now = time.monotonic()
                if code < 0:
                    line = f"killed by {signal.Signals(-code).name}"
                else:
                    line = _last_line(self.logs[name]) if code else ""
                self.event(
                    "exit", attempt=attempt, process=name, pid=proc.pid, code=code, error=line
                )
                if code:
                    when = (
                        f"{now - started:.1f} s after start"
                        if first_failure is None
                        else f"{now - first_failure:.1f} s after the first failure"
                    )
                    self.say(
                        f"attempt {attempt}: {name} (pid {proc.pid}) exited with {code} "
                        f"{when}{': ' + line if line else ''}"
                    )
                    if first_failure is None:
                        first_failure = now
            if (
                first_failure is not None
                and time.monotonic() - first_failure > self.options.grace_s
            ):
                for name in self.kill_all():
                    self.event("kill", attempt=attempt, process=name)
                    self.say(
                        f"attempt {attempt}: killed {name}, still running "
                        f"{self.options.grace_s:g} s after the first failure"
                    )
                continue
            time.sleep(0.05)
        return all(code == 0 for code in exited.values())

    def run(self) -> int:
        for attempt in range(self.options.max_restarts + 1):
            if attempt:
                root = Path(self.config.checkpoint_dir or self.run_dir / "checkpoints")
                found = latest_complete(root)
                where = (
                    f"step {found.step} ({found.path})" if found else "the start (no checkpoint)"
                )
                self.event("restart", attempt=attempt, resume_step=found.step if found else 0)
                self.say(f"restart {attempt} of {self.options.max_restarts}: resuming from {where}")
            self.procs, self.logs = {}, {}
            try:
                self.start(attempt)
                ok = self.watch(attempt)
            finally:
                self.kill_all()
            if ok:
                self.event("done", attempt=attempt)
                self.say(f"attempt {attempt}: job finished (run {self.run_id})")
                return 0
        self.event("failed", attempts=self.options.max_restarts + 1)
        self.say(f"job failed after {self.options.max_restarts} restarts (run {self.run_id})")
        return 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m distopt.roles.supervise",
        description="Run a distopt job's processes on this host; restart the job on failure.",
    )
    add_job_arguments(parser)
    add_process_arguments(parser, num_ps=1, num_trainers=1)
    parser.add_argument("--max-restarts", type=int, default=3, help="restarts after failures")
    parser.add_argument(
        "--grace-s",
        type=float,
        default=30.0,
        help="seconds the other processes get to exit after a failure",
    )
    parser.add_argument("--host", default="127.0.0.1", help="address the job listens on")
    parser.add_argument("--iface", default="lo", help="interface of gloo and TensorPipe")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        options = SuperviseOptions(
            config=args.config,
            overrides=tuple(args.overrides),
            num_ps=args.num_ps,
            num_trainers=args.num_trainers,
            max_restarts=args.max_restarts,
            grace_s=args.grace_s,
            host=args.host,
            iface=args.iface,
            run_id=args.run_id,
        )
        config = load_config(JobConfig, args.config, args.overrides)
        supervisor = Supervisor(options, config, out=sys.stdout)
    except DistoptError as err:
        print(f"distopt.roles.supervise: error: {err}", file=sys.stderr)
        return 2

    def stop(signum: int, _frame: Any) -> None:
        supervisor.kill_all()
        sys.exit(128 + signum)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    return supervisor.run()


if __name__ == "__main__":
    sys.exit(main())
