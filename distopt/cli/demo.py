"""``distopt demo`` (what ``make demo`` runs): the parameter-server workload, baseline vs optimized.

Launches ``configs/jobs/ps_dlrm.yaml`` twice through TorchX on ``local_cwd`` (1 parameter server
+ 2 DDP trainers each): once as written (``variant=baseline``) and once rewritten by
``distopt.optimize`` (``variant=optimized``); then prints the ``distopt compare`` table and writes
the plot.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

from distopt.errors import DistoptError
from distopt.rendezvous import free_port

REPO = Path(__file__).resolve().parents[2]


def add_parser(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("demo", help="run the PS workload baseline vs optimized and compare")
    parser.add_argument("--config", default="configs/jobs/ps_dlrm.yaml", help="job config")
    parser.add_argument("--steps", type=int, default=150, help="training steps per run")
    parser.add_argument("--out", default="runs/demo", help="where logs and the plot go")
    parser.set_defaults(func=run)


def _launch(args: argparse.Namespace, variant: str, run_id: str, out: Path) -> None:
    overrides = f"variant={variant},steps={args.steps},output_dir={out}"
    cmd = [
        sys.executable, "-m", "torchx.cli.main", "run", "-s", "local_cwd",
        "-cfg", f"log_dir={out / 'torchx'}",
        "launchers/components.py:ps_job", "--config", args.config, "--set", overrides,
        "--run_id", run_id, "--master_port", str(free_port()),
    ]
    print(f"$ {' '.join(cmd[2:])}", flush=True)
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    if proc.returncode != 0:
        raise DistoptError(f"demo: the {variant} job failed (exit {proc.returncode}); logs in {out / 'torchx'}")
    print(f"{variant} job finished in {time.perf_counter() - start:.0f} s", flush=True)


def run(args: argparse.Namespace) -> int:
    from distopt.cli import main as distopt_main

    out = (REPO / args.out).resolve() if not Path(args.out).is_absolute() else Path(args.out)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    runs = []
    for variant in ("baseline", "optimized"):
        run_id = f"demo-{stamp}-{variant}"
        _launch(args, variant, run_id, out)
        runs.append(str(out / run_id))
    plot = out / f"demo-{stamp}.png"
    code = distopt_main(["compare", *runs, "--plot", str(plot)])
    return code
