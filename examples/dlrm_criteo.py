"""A DLRM on a Criteo-format click log, with parameter servers: baseline vs optimized, compared.

    python examples/dlrm_criteo.py [--samples 12000] [--steps 80] [--out runs/examples/dlrm]

Writes a learnable click log (``distopt.data.generate``), then launches
``configs/jobs/dlrm_criteo.yaml`` twice through TorchX on ``local_cwd`` (1 parameter server + 2
DDP trainers each): as written, and rewritten by ``distopt.optimize``. The jobs are deterministic,
so both learn exactly the same model (same losses, same held-out AUC); only the speed differs.
Last, ``distopt compare`` puts the two runs side by side.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import distopt
from distopt.cli import main as distopt_cli
from distopt.data.generate import write_criteo
from distopt.metrics import load_run

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "jobs" / "dlrm_criteo.yaml"


def run(samples: int, steps: int, out: Path) -> dict[str, float]:
    """Train both variants; the final held-out AUC of each (and exits non-zero on a failed job)."""
    clicks = write_criteo(out / "clicks.tsv", num_samples=samples, seed=0)
    auc = {}
    for variant in ("baseline", "optimized"):
        job = distopt.launch(
            CONFIG, "local_cwd",
            overrides=[f"data.path={clicks}", f"output_dir={out}", f"variant={variant}",
                       f"steps={steps}", f"eval.every={steps // 2}"],
            run_id=f"dlrm-{variant}", num_trainers=2, num_ps=1,
            log_dir=str(out / "torchx"),
        )  # fmt: skip
        with job:
            status = job.wait()
            print(f"{variant}: {job.handle} {status.state}", flush=True)
            report = job.failure_report(status)  # which process failed first, and its error
        if report is not None:
            sys.exit(f"{report}\nlogs under {out / 'torchx'}")
        evaluation = load_run(job.run_dir).ranks[0].evals[-1]
        auc[variant] = evaluation.metrics["eval_auc"]
        print(f"{variant}: held-out AUC {auc[variant]:.4f} after {evaluation.step} steps")
    distopt_cli(
        ["compare", str(out / "dlrm-baseline"), str(out / "dlrm-optimized"), "--warmup", "3"]
    )
    return auc


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=12_000, help="lines of the click log")
    parser.add_argument("--steps", type=int, default=80, help="training steps per run")
    parser.add_argument("--out", type=Path, default=Path("runs/examples/dlrm"))
    args = parser.parse_args(argv)
    run(args.samples, args.steps, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
