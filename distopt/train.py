"""Training entry point: ``python -m distopt.train --config configs/jobs/<job>.yaml [--set k=v ...]``.

The process's role comes from the environment (see :mod:`distopt.dist.env`): a trainer (default)
trains and writes its QPS log; a ``ps`` process serves parameter-server tables until the trainers
finish. Single process: ``python -m distopt.train --config configs/jobs/mlp.yaml``. DDP on one host:
``torchrun --standalone --nproc-per-node 2 -m distopt.train --config configs/jobs/mlp_ddp.yaml``.

Exit status 0 on success, 2 on a configuration or environment error (one line on stderr), 1 when
training itself fails (a parameter server lost or timed out: one line naming it; else a traceback).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import faulthandler
import logging
import socket
import sys
from pathlib import Path

import torch

from distopt.config import load_config
from distopt.dist.env import JobEnv
from distopt.dist.group import trainer_group
from distopt.errors import DistoptError, RemoteCallError
from distopt.roles.ps_roles import run_ps_role
from distopt.training.config import JobConfig, add_job_arguments, launched_output_dir
from distopt.training.device import resolve_device
from distopt.training.logs import configure, record_failure
from distopt.training.trainer import train

logger = logging.getLogger("distopt.train")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m distopt.train", description="Run one distopt training job process."
    )
    add_job_arguments(parser)
    return parser


def run(config: JobConfig, env: JobEnv) -> int:
    """Run this process's role of the job."""
    if config.num_threads is not None:
        torch.set_num_threads(config.num_threads)
    if env.role == "trainer":
        resolve_device(config.device, local_rank=env.local_rank)  # no GPU: fail before any group
    if env.role == "ps" or env.num_ps > 0:
        return run_ps_role(config, env)
    needs_group = env.num_trainers > 1 or config.parallel != "none"
    group = trainer_group(env, timeout_s=config.collective_timeout_s)
    with group if needs_group else contextlib.nullcontext(()) as hosts:
        result = train(config, dataclasses.replace(env, hosts=hosts))
    if env.rank == 0:
        logger.info(
            "run %s: %d steps, QPS log %s",
            result.run_id,
            result.steps,
            _where(result.log_path, config, env),
        )
    return 0


def _where(path: Path, config: JobConfig, env: JobEnv) -> str:
    """``path`` as the user finds it: absolute, with the host, where the job ran in a copy of the
    workspace that the launching machine does not see (a remote Ray cluster's ``working_dir``)."""
    launched = env.launch_run_dir
    if launched is None or Path(config.output_dir) == Path(launched).parent:
        return str(path)
    return (
        f"{path.resolve()} on {socket.gethostname()} (in this job's working directory, not in "
        f"{launched} of the machine that launched it: copy it from there)"
    )


def main(argv: list[str] | None = None, *, prog: str = "distopt.train") -> int:
    """Parse ``argv``, load the config and run this process's role; the exit status.

    A failure is also recorded where the launcher reads it (torchelastic's error file,
    ``$TORCHELASTIC_ERROR_FILE``, which TorchX and torchrun set for every process): TorchX's
    status and ``distopt launch`` name the process that failed first and why. Faults (SIGABRT,
    SIGSEGV) print every thread's stack (``faulthandler``), so an abort names its cause.
    """
    # torchelastic's ErrorHandler.initialize() does this too, but warns where sys.stderr has no
    # file descriptor (a notebook, captured output): there is nothing to print a fault to then.
    with contextlib.suppress(ValueError, OSError):
        faulthandler.enable(all_threads=True)
    args = build_parser().parse_args(argv)
    try:
        env = JobEnv.from_environ()
        config = launched_output_dir(
            load_config(JobConfig, args.config, args.overrides), args.config, env.launch_run_dir
        )
        configure(env.role, env.rank)
        return run(config, env)
    except DistoptError as err:
        # A server failed mid-run (RemoteCallError): 1, not a configuration problem (2).
        print(f"{prog}: error: {err}", file=sys.stderr)
        record_failure(err)
        return 1 if isinstance(err, RemoteCallError) else 2
    except Exception as err:
        record_failure(err)
        raise


if __name__ == "__main__":
    sys.exit(main())
