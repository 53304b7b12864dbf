"""Launch a user job of this folder as its user would: the job's folder copied outside the
repository, ``distopt launch job.yaml --set variant=...`` run there from a shell whose ``PATH``
starts with this venv's ``bin`` (no ``PYTHONPATH``: the job's package is found in the working
directory, as the job's own processes find it)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

from distopt.dist.rendezvous import free_port
from distopt.metrics import load_run
from distopt.metrics.records import RunLog
from tests import shell

HERE = Path(__file__).resolve().parent
VARIANTS = ("baseline", "optimized")


def copy_out(name: str, tmp_path: Path) -> Path:
    """The job folder ``name`` copied to ``tmp_path`` (outside the repository)."""
    return Path(
        shutil.copytree(HERE / name, tmp_path / name, ignore=shutil.ignore_patterns("__pycache__"))
    )


def distopt_cli(
    *args: str, cwd: Path, env: dict[str, str] | None = None, timeout: float = 600
) -> subprocess.CompletedProcess[str]:
    """``distopt ARGS`` in ``cwd``."""
    return shell.run("distopt", *args, cwd=cwd, env=env, timeout=timeout)


def replica_logs(work: Path, run_id: str) -> dict[str, str]:
    """``role/replica`` → stderr of every replica of run ``run_id``."""
    found = sorted((work / "runs" / "torchx" / run_id).glob("*/*/*/*/stderr.log"))
    return {f"{p.parent.parent.name}/{p.parent.name}": p.read_text() for p in found}


def launch(
    work: Path,
    variant: str,
    *,
    ps: bool,
    num_trainers: int = 2,
    run_id: str | None = None,
    sets: tuple[str, ...] = (),
    env: dict[str, str] | None = None,
) -> subprocess.CompletedProcess[str]:
    """``distopt launch job.yaml --set variant=VARIANT`` in ``work``; it must succeed."""
    run_id = run_id or variant
    args = [
        "launch",
        "job.yaml",
        "--set",
        f"variant={variant}",
        "--run-id",
        run_id,
        "--num-trainers",
        str(num_trainers),
        "--cfg",
        f"log_dir=runs/torchx/{run_id}",
    ]
    for item in sets:
        args += ["--set", item]
    if ps:  # the RPC group's port; parallel tests must not share the default 29500
        args += ["--arg", f"master_port={free_port(consecutive=2)}"]
    proc = distopt_cli(*args, cwd=work, env=env)
    if proc.returncode != 0:
        logs = "\n".join(
            f"--- {name}\n{text[-2000:]}" for name, text in replica_logs(work, run_id).items()
        )
        raise AssertionError(
            f"distopt launch ({variant}) exited {proc.returncode}\n{proc.stdout[-2000:]}"
            f"\n{proc.stderr[-3000:]}\n{logs}"
        )
    return proc


def launch_both(work: Path, **kwargs: object) -> dict[str, RunLog]:
    """Both variants launched one after the other; their QPS logs."""
    for variant in VARIANTS:
        launch(work, variant, **kwargs)  # type: ignore[arg-type]
    return {variant: load_run(work / "runs" / variant) for variant in VARIANTS}


def losses(run: RunLog) -> dict[int, list[float | None]]:
    """Every trainer's loss at every step."""
    return {rank: [s.loss for s in log.steps] for rank, log in run.ranks.items()}


def trainer_log(work: Path, run_id: str) -> str:
    """Trainer 0's stderr in run ``run_id``."""
    return replica_logs(work, run_id)["trainer/0"]
