"""``distopt launch JOB.yaml [-s SCHEDULER] [--cfg k=v,...] [--set k=v ...]``: submit a job
through TorchX (:func:`distopt.launch`) and print its app handle and run id.

On a local scheduler it streams trainer 0's log while the job runs and exits with its status
(0: succeeded, 1: not, after naming the process that failed first, its exit code, its error, the
end of its log and where the logs are); elsewhere it returns once submitted, unless ``--wait``
(which streams trainer 0's log too where the scheduler tails it: distopt's Ray scheduler).
``--dryrun`` prints the request instead.
"""

from __future__ import annotations

import argparse
import sys

from torchx.specs.api import to_dict

from distopt.errors import ConfigError
from distopt.torchx.submit import LOCAL_SCHEDULERS, launch, tails_replica_logs
from distopt.training.config import add_job_arguments, add_process_arguments


def add_parser(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "launch",
        help="submit a training job through TorchX",
        description=(__doc__ or "").split("\n\n")[0],
    )
    add_job_arguments(parser, positional=True)
    parser.add_argument(
        "-s", "--scheduler", default="local_cwd", help="TorchX scheduler (default local_cwd)"
    )
    parser.add_argument(
        "--cfg",
        default="",
        metavar="K=V,...",
        help="scheduler options, e.g. partition=gpu,account=ml (over .torchxconfig)",
    )
    add_process_arguments(parser, num_ps=None, num_trainers=2)
    parser.add_argument(
        "--arg",
        dest="component_args",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="more component arguments, e.g. cpu=4 (repeatable)",
    )
    parser.add_argument("--dryrun", action="store_true", help="print the request, submit nothing")
    parser.add_argument("--wait", action="store_true", help="wait for a remote job to finish")
    parser.set_defaults(func=run)


def _pairs(items: list[str], flag: str) -> dict[str, str]:
    pairs = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"{flag}: expected NAME=VALUE, got {item!r}")
        pairs[key] = value
    return pairs


def _cfg(text: str) -> dict[str, str]:
    """``--cfg k=v,...`` split as TorchX splits it (list values keep their commas); the options are
    checked and typed by :func:`distopt.torchx.submit.scheduler_options`, as for the Python API."""
    try:
        return to_dict(text)
    except ValueError as err:
        raise ConfigError(f"--cfg: {str(err).strip().splitlines()[0]}") from None


def run(args: argparse.Namespace) -> int:
    cfg = _cfg(args.cfg)
    job = launch(
        args.config,
        args.scheduler,
        overrides=args.overrides,
        num_trainers=args.num_trainers,
        num_ps=args.num_ps,
        run_id=args.run_id,
        component_args=_pairs(args.component_args, "--arg"),
        dryrun=args.dryrun,
        **cfg,
    )
    with job:
        if args.dryrun:
            print(job.dryrun)
            print(f"run id {job.run_id}: logs would go to {job.run_dir}")
            return 0
        print(f"{job.handle}\nrun id {job.run_id}: logs in {job.run_dir}", flush=True)
        if args.scheduler not in LOCAL_SCHEDULERS and not args.wait:
            return 0
        progress = job.stream() if tails_replica_logs(args.scheduler) else None
        status = job.wait()
        if progress is not None:
            progress.join()
        report = job.failure_report(status)
        if report is not None:
            print(report, file=sys.stderr, flush=True)
            return 1
        elsewhere = job.logs_elsewhere() if args.scheduler not in LOCAL_SCHEDULERS else None
        if elsewhere:
            print(elsewhere, file=sys.stderr, flush=True)
        print(f"{job.handle}: SUCCEEDED", file=sys.stderr, flush=True)
        return 0
