"""The job config read by ``python -m distopt.train --config JOB.yaml``."""

from __future__ import annotations

import argparse
import dataclasses
import os
from pathlib import Path
from typing import Any, Literal

from distopt.config import check
from distopt.data.config import DataConfig
from distopt.pipeline.config import PipelineConfig
from distopt.ps.spec import ServerOptions
from distopt.training.evaluate import EvalConfig
from distopt.training.optim import OptimConfig

Variant = Literal["baseline", "optimized", "hand"]
Parallel = Literal["none", "ddp", "fsdp"]
Device = Literal["auto", "cpu", "cuda"]
Precision = Literal["fp32", "bf16"]


@dataclasses.dataclass(kw_only=True, slots=True)
class JobConfig:
    """One training job. The same file serves every variant: ``--set variant=optimized``."""

    model: str
    """Registered model name (``distopt.models.names()``) or ``package.module:factory``."""
    model_kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)
    """Keyword arguments of the model factory."""
    hand_model: str | None = None
    """Model built instead of ``model`` (same ``model_kwargs``) when ``variant`` is ``hand``: the
    hand-optimized equivalent used as the practical ideal."""
    variant: Variant = "baseline"
    """What this run measures: the model as written, distopt-optimized, or hand-optimized."""
    optimize: bool | None = None
    """Run ``distopt.optimize`` on the model; ``None`` means "when variant is optimized"."""
    optimize_config: dict[str, Any] = dataclasses.field(default_factory=dict)
    """``config`` mapping passed to ``distopt.optimize`` (see ``distopt.config.OptimizeConfig``)."""
    parallel: Parallel = "none"
    """Data parallelism among trainers: none, DDP or FSDP2 (``distopt.parallelize`` when
    optimized); over NCCL on CUDA, gloo on CPU."""
    device: Device = "auto"
    """Where each trainer computes: ``cuda`` (GPU ``LOCAL_RANK``; an error before anything starts
    when there is none), ``cpu``, or ``auto`` (CUDA when available)."""
    precision: Precision = "fp32"
    """``bf16``: autocast to bfloat16 on CPU and CUDA; under FSDP, parameters are gathered in bf16
    and gradients reduced in fp32 (FSDP2 ``MixedPrecisionPolicy``) instead."""
    steps: int = 100
    """Optimizer steps per trainer (each of ``optim.accumulate_steps`` micro-batches)."""
    batch_size: int = 32
    """Samples per trainer per micro-batch; a step's global batch is
    ``batch_size × optim.accumulate_steps × trainers``."""
    seed: int = 0
    """Seeds parameters (same on every trainer), data order and synthetic data (per trainer)."""
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    """Training and held-out data and their loaders (see ``docs/data.md``)."""
    optim: OptimConfig = dataclasses.field(default_factory=OptimConfig)
    """Dense optimizer, learning-rate schedule, clipping and accumulation. Parameter-server
    tables use their own optimizer (``TableSpec.optimizer``) at ``optim.sparse_lr``."""
    eval: EvalConfig = dataclasses.field(default_factory=EvalConfig)
    """Held-out evaluation every ``eval.every`` steps and at the end."""
    output_dir: str = "runs"
    """QPS logs go to ``<output_dir>/<run_id>/qps-rank<r>.jsonl``, TensorBoard events to
    ``<output_dir>/<run_id>/tensorboard``."""
    tensorboard: bool = True
    """Trainer 0 writes TensorBoard scalars (loss, QPS, lr, remote wait, eval metrics)."""
    run_id: str | None = None
    """Run id; default ``$DISTOPT_RUN_ID``, else ``<variant>-<time>-<random>`` chosen by rank 0."""
    checkpoint_every: int = 0
    """Checkpoint every N steps and after the last one (0: never): dense model and optimizer,
    step, RNG states and the parameter servers' tables (see ``distopt.training.checkpoint``)."""
    checkpoint_dir: str | None = None
    """Where checkpoints go; default ``<output_dir>/<run_id>/checkpoints``."""
    keep_checkpoints: int = 0
    """Keep only the N newest complete checkpoints (0: keep all)."""
    resume: bool = False
    """Start from the newest complete checkpoint in ``checkpoint_dir`` when there is one
    (incomplete ones, left by a job killed while writing, are ignored)."""
    deterministic: bool = False
    """Bitwise-reproducible parameter-server training with several trainers: each step's pushes
    to distopt's tables are applied in trainer-rank order and before any trainer's next fetch
    (costs a barrier per trainer per step). Writes of the model's own server functions are not
    ordered by it. A lone trainer is reproducible without it."""
    pipeline: PipelineConfig = dataclasses.field(default_factory=PipelineConfig)
    """Prefetch the optimized model's remote reads of the next batches while a step trains."""
    log_every: int = 10
    """Without a TTY, log a progress line every N steps (level INFO; ``DISTOPT_LOG_LEVEL``)."""
    num_threads: int | None = None
    """torch intra-op threads per process; ``None`` keeps torch's default (``OMP_NUM_THREADS``)."""
    collective_timeout_s: float = 120.0
    """Deadline of the trainers' process group (DDP/FSDP jobs): forming it and every collective.
    A trainer whose peer died, hangs or lost its link fails after this long in one line naming the
    peer's host."""
    ps: ServerOptions = dataclasses.field(default_factory=ServerOptions)
    """Parameter-server options, used when the launcher starts ``ps`` processes. In a launched
    job ``num_servers`` comes from ``DISTOPT_NUM_PS`` and ``host`` from ``DISTOPT_PS_ADDR``."""

    def __post_init__(self) -> None:
        check(bool(self.model), "model", "a model name", self.model)
        check(self.steps >= 1, "steps", "an integer >= 1", self.steps)
        check(self.batch_size >= 1, "batch_size", "an integer >= 1", self.batch_size)
        check(
            self.checkpoint_every >= 0, "checkpoint_every", "an integer >= 0", self.checkpoint_every
        )
        check(self.log_every >= 1, "log_every", "an integer >= 1", self.log_every)
        check(
            self.keep_checkpoints >= 0, "keep_checkpoints", "an integer >= 0", self.keep_checkpoints
        )
        check(
            self.collective_timeout_s > 0,
            "collective_timeout_s",
            "a number > 0",
            self.collective_timeout_s,
        )
        if self.num_threads is not None:
            check(self.num_threads >= 1, "num_threads", "an integer >= 1", self.num_threads)
        check(
            self.variant != "hand" or self.hand_model is not None,
            "hand_model",
            "a model name when variant is 'hand'",
            self.hand_model,
        )
        if self.run_id is not None:
            check(
                bool(self.run_id) and "/" not in self.run_id and self.run_id not in (".", ".."),
                "run_id",
                "a non-empty name without '/'",
                self.run_id,
            )

        builtin = self.data.source in ("synthetic", "criteo", "tokens")
        held_out = self.data.holdout_fraction > 0 or self.data.eval_path is not None
        check(
            self.eval.every == 0 or not builtin or held_out,
            "eval.every",
            "0 without held-out data (set data.holdout_fraction or data.eval_path)",
            self.eval.every,
        )

        check(
            not self.pipeline.enabled or self.runs_optimize,
            "pipeline.enabled",
            f"false unless the model is optimized (variant {self.variant!r} runs it as written)",
            self.pipeline.enabled,
        )
        check(
            not self.pipeline.enabled or self.parallel != "fsdp",
            "pipeline.enabled",
            "false with parallel: fsdp (FSDP models have no remote reads to prefetch)",
            self.pipeline.enabled,
        )
        check(
            self.pipeline.max_staleness is None
            or (self.pipeline.staleness >= 1 and not self.deterministic),
            "pipeline.max_staleness",
            "null unless pipeline.staleness >= 1 and deterministic is false (an adapting depth "
            "follows the host's timing)",
            self.pipeline.max_staleness,
        )

    @property
    def lr(self) -> float:
        """Learning rate of parameter-server pushes, ``optim.table_lr`` (not a config key: the
        parameter-server role reads it here)."""
        return self.optim.table_lr

    @property
    def runs_optimize(self) -> bool:
        """Whether ``distopt.optimize`` runs in this job."""
        return self.variant == "optimized" if self.optimize is None else self.optimize

    @property
    def model_name(self) -> str:
        """The registry name actually built for this variant."""
        return self.hand_model if self.variant == "hand" and self.hand_model else self.model


def launched_output_dir(
    config: JobConfig, config_path: str | os.PathLike[str], launch_run_dir: str | None
) -> JobConfig:
    """``config`` writing into ``launch_run_dir`` (``$DISTOPT_LAUNCH_RUN_DIR``: the run directory
    of the machine that ran ``distopt launch``) when this process sees that directory: it holds
    the very ``job.yaml`` this process was given (at ``config_path``), so it is this run's.

    On Ray the job's processes start in a copy of the workspace (``working_dir``) and would write
    ``runs/<run_id>`` inside it, where neither the user nor ``distopt compare`` looks. On the
    launching host, or on a filesystem shared with it, they write where ``distopt launch``
    said the logs are; elsewhere (a remote cluster) the config is unchanged."""
    if not launch_run_dir or not config.run_id:
        return config
    there = Path(launch_run_dir)
    if there.name != config.run_id:
        return config
    try:
        same = (there / "job.yaml").read_bytes() == Path(config_path).read_bytes()
    except OSError:  # not on this host
        return config
    return dataclasses.replace(config, output_dir=str(there.parent)) if same else config


def add_job_arguments(parser: argparse.ArgumentParser, *, positional: bool = False) -> None:
    """A job config as every command that runs or submits a job takes it: ``--config JOB.yaml``
    (``positional``: a ``config`` argument) and ``--set KEY=VALUE`` overrides, repeatable
    (``args.config``, ``args.overrides``; :func:`distopt.config.load_config` takes both)."""
    config_help = "job config YAML (see configs/jobs/)"
    if positional:
        parser.add_argument("config", help=config_help)
    else:
        parser.add_argument("--config", required=True, help=config_help)
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config key (dotted for nested keys; value parsed as YAML); repeatable",
    )


def add_process_arguments(
    parser: argparse.ArgumentParser, *, num_ps: int | None, num_trainers: int
) -> None:
    """The processes of a job and its run id, as ``distopt launch`` and the supervisor take them:
    ``--num-ps`` (default ``num_ps``; ``None``: 1 for a model with ``ps_tables()``, else 0),
    ``--num-trainers`` and ``--run-id``."""
    if num_ps is None:
        ps_help = "parameter servers (default: 1 for models with ps_tables(), else 0)"
    else:
        ps_help = f"parameter servers (default {num_ps}; 0: none)"
    parser.add_argument("--num-ps", type=int, default=num_ps, help=ps_help)
    parser.add_argument(
        "--num-trainers",
        type=int,
        default=num_trainers,
        help=f"trainer processes (default {num_trainers})",
    )
    parser.add_argument(
        "--run-id", default=None, help="run id (default: the config's, else a new one)"
    )
