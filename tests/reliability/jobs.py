"""Helpers for the fault tests: run a job under ``distopt.roles.supervise``, kill one of its processes by
PID at a chosen step, read what happened."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from distopt.training.checkpoint import latest_complete
from distopt.training.state import read_tensors

ROOT = Path(__file__).resolve().parents[2]
DLRM_TINY = ROOT / "configs" / "jobs" / "ps_dlrm_tiny.yaml"
# 2 servers x 2 DDP trainers, Adagrad tables, a checkpoint every 4 steps. deterministic: pushes in
# rank order, so two runs with the same seed end bitwise equal. 20 ms server latency makes a step
# ~0.1 s, so the test's kill lands at the step it chose.
FAULT_JOB = (
    "steps=24", "checkpoint_every=4", "deterministic=true", "model_kwargs.optimizer=adagrad",
    "ps.latency_ms=20", "ps.rpc_timeout_s=10", "ps.trainer_timeout_s=5", "log_every=4",
)  # fmt: skip
JOB_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "DISTOPT_ROLE",
            "DISTOPT_NUM_PS", "DISTOPT_NUM_TRAINERS", "REPLICA_ID", "DISTOPT_RUN_ID",
            "DISTOPT_PS_ADDR", "DISTOPT_DDP_PORT", "TORCHELASTIC_USE_AGENT_STORE",
            "DISTOPT_ATTEMPT", "TORCHELASTIC_RESTART_COUNT", "SLURM_RESTART_COUNT")  # fmt: skip


def job_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in JOB_ENV}
    env["OMP_NUM_THREADS"] = "1"  # several processes share two cores
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    return env


@dataclasses.dataclass(kw_only=True, slots=True)
class Supervised:
    """A finished supervised run."""

    run_dir: Path
    returncode: int
    output: str
    events: list[dict[str, Any]]
    killed_step: int | None = None
    killed_at: float | None = None
    """Wall-clock time of the SIGKILL."""

    def exits(self, attempt: int) -> list[dict[str, Any]]:
        return [e for e in self.events if e["event"] == "exit" and e["attempt"] == attempt]

    def event(self, kind: str) -> dict[str, Any]:
        return next(e for e in self.events if e["event"] == kind)

    def final_tensors(self) -> dict[str, torch.Tensor]:
        found = latest_complete(self.run_dir / "checkpoints")
        assert found is not None, f"no complete checkpoint in {self.run_dir}"
        return read_tensors(found)


def _events(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "supervisor.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]


def _logged_step(run_dir: Path) -> int:
    """Highest step trainer 0 has logged (-1 before any)."""
    path = run_dir / "qps-rank0.jsonl"
    if not path.exists():
        return -1
    steps = [-1]
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue  # a line still being written
        if record.get("type") == "step":
            steps.append(record["step"])
    return max(steps)


def supervise(
    out: Path,
    run_id: str,
    *,
    sets: tuple[str, ...] = FAULT_JOB,
    num_ps: int = 2,
    num_trainers: int = 2,
    max_restarts: int = 2,
    grace_s: float = 20.0,
    kill: str | None = None,
    at_step: int = 0,
    timeout_s: float = 150.0,
) -> Supervised:
    """Run ``distopt.roles.supervise`` on the tiny DLRM job; with ``kill``, SIGKILL that process (by the
    PID the supervisor recorded) once trainer 0 has logged step ``at_step`` of the first attempt."""
    args = [a for s in (f"output_dir={out}", *sets) for a in ("--set", s)]
    cmd = [
        sys.executable, "-m", "distopt.roles.supervise", "--config", str(DLRM_TINY),
        "--num-ps", str(num_ps), "--num-trainers", str(num_trainers),
        "--max-restarts", str(max_restarts), "--grace-s", str(grace_s), "--run-id", run_id, *args,
    ]  # fmt: skip
    run_dir = out / run_id
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=job_env(), cwd=ROOT
    )
    deadline = time.monotonic() + timeout_s
    result = Supervised(run_dir=run_dir, returncode=-1, output="", events=[])
    try:
        if kill is not None:
            while (step := _logged_step(run_dir)) < at_step:
                assert proc.poll() is None, f"job ended before step {at_step}"
                assert time.monotonic() < deadline, f"step {at_step} not reached in {timeout_s} s"
                time.sleep(0.005)
            pid = next(e["pid"] for e in _events(run_dir) if e.get("process") == kill)
            os.kill(pid, signal.SIGKILL)
            result.killed_at, result.killed_step = time.time(), step
        out_text, _ = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        if proc.poll() is None:  # the supervisor kills its children by PID on SIGTERM
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    result.returncode, result.output, result.events = proc.returncode, out_text, _events(run_dir)
    return result


def assert_same_tensors(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    """Bitwise equality of two checkpoints' tensors, naming the first difference."""
    assert sorted(got) == sorted(want)
    for name in sorted(want):
        diff = (got[name].double() - want[name].double()).abs().max().item()
        assert torch.equal(got[name], want[name]), f"{name} differs (max abs diff {diff:.3g})"
