"""Train your own ``rpc_sync`` model as a job: 1 parameter server + 2 trainers on ``local_cwd``.

    python examples/own_model/run.py [--steps 120] [--out runs/examples/own_model] [--variant optimized]

Run it from the repository's root: the job names its code ``examples.own_model.model:...``, which
the job's processes import from the directory they run in. Prints the held-out AUC (the data's
labels follow the remote rows, so it must learn them).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import distopt
from distopt.metrics import load_run

CONFIG = Path(__file__).resolve().with_name("job.yaml")


def run(steps: int, out: Path, variant: str = "baseline") -> float:
    """The final held-out AUC (exits non-zero on a failed job)."""
    job = distopt.launch(
        CONFIG, "local_cwd",
        overrides=[f"output_dir={out}", f"steps={steps}", f"eval.every={steps}", f"variant={variant}"],
        run_id=f"own-{variant}", num_trainers=2, num_ps=1,
        log_dir=str(out / "torchx"),
    )  # fmt: skip
    with job:
        status = job.wait()
        print(f"{job.handle} {status.state}", flush=True)
        report = job.failure_report(status)  # which process failed first, and its error
    if report is not None:
        sys.exit(f"{report}\nlogs under {out / 'torchx'}")
    auc = load_run(job.run_dir).ranks[0].evals[-1].metrics["eval_auc"]
    print(f"held-out AUC {auc:.4f}")
    return auc


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--out", type=Path, default=Path("runs/examples/own_model"))
    parser.add_argument("--variant", default="baseline", choices=("baseline", "optimized"))
    args = parser.parse_args(argv)
    run(args.steps, args.out, args.variant)
    return 0


if __name__ == "__main__":
    sys.exit(main())
