"""Print what ``distopt launch`` would submit to a Slurm or Ray cluster, without one.

    python examples/clusters/dryrun.py slurm|ray [--config configs/jobs/dlrm_criteo.yaml]

Uses the options of ``examples/clusters/<scheduler>.torchxconfig`` (as a ``.torchxconfig`` in
the launch directory would give them) and writes a small click log for the config to open.
"""

from __future__ import annotations

import argparse
import configparser
import sys
import tempfile
from pathlib import Path

import distopt
from distopt.data.generate import write_criteo

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]


def options(scheduler: str) -> tuple[dict[str, str], dict[str, str]]:
    """``(scheduler options, ps_job component arguments)`` of ``<scheduler>.torchxconfig``."""
    parser = configparser.ConfigParser()
    parser.optionxform = str  # type: ignore[assignment,method-assign]  # keep memMB's case
    parser.read(HERE / f"{scheduler}.torchxconfig")
    return dict(parser[scheduler]), dict(parser["component:distopt.ps_job"])


def dryrun(scheduler: str, config: Path, out: Path) -> distopt.torchx.submit.Launched:
    # A full first batch: the job is checked before it is submitted.
    clicks = write_criteo(out / "clicks.tsv", num_samples=1000, seed=0)
    cfg, component = options(scheduler)
    return distopt.launch(
        config,
        scheduler,
        overrides=[f"data.path={clicks}", f"output_dir={out}"],
        run_id=f"dryrun-{scheduler}",
        dryrun=True,
        component_args=component,
        **cfg,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("scheduler", choices=("slurm", "ray"))
    parser.add_argument(
        "--config", type=Path, default=ROOT / "configs" / "jobs" / "dlrm_criteo.yaml"
    )
    args = parser.parse_args(argv)
    with (
        tempfile.TemporaryDirectory() as out,
        dryrun(args.scheduler, args.config, Path(out)) as job,
    ):
        print(job.dryrun)
    return 0


if __name__ == "__main__":
    sys.exit(main())
