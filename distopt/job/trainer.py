"""The trainer role: build the model, optionally optimize and parallelize it, train, log QPS."""

from __future__ import annotations

import dataclasses
import secrets
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from distopt import models
from distopt.config import to_dict
from distopt.errors import ConfigError
from distopt.job.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from distopt.job.config import JobConfig
from distopt.job.env import JobEnv
from distopt.job.progress import Progress
from distopt.metrics.qps_log import QpsLogWriter


@dataclasses.dataclass(kw_only=True, slots=True, frozen=True)
class Hooks:
    """What a role adds to the plain training loop (the parameter-server trainer uses all four)."""

    before_loop: Callable[[], None] | None = None
    """After the model is built, optimized and parallelized (e.g. forget verification fetches)."""
    after_backward: Callable[[nn.Module], None] | None = None
    """After ``backward`` of every step (e.g. push gradients of fetched rows)."""
    checkpoint_state: Callable[[], dict[str, Any]] | None = None
    """Extra entries saved in every checkpoint (e.g. the parameter-server tables)."""
    restore_state: Callable[[dict[str, Any]], None] | None = None
    """Called with the loaded checkpoint on resume."""


@dataclasses.dataclass(kw_only=True, slots=True, frozen=True)
class TrainResult:
    """What one trainer did."""

    run_id: str
    rank: int
    steps: int
    """Steps run by this process (fewer than ``config.steps`` after a resume)."""
    log_path: Path
    final_loss: float
    checkpoints: tuple[Path, ...]


def resolve_run_id(config: JobConfig, env: JobEnv) -> str:
    """Config, then ``$DISTOPT_RUN_ID``, then an id chosen by trainer 0 and shared over gloo."""
    if config.run_id is not None:
        return config.run_id
    if env.run_id is not None:
        return env.run_id
    chosen = [f"{config.variant}-{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(3)}"]
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(chosen, src=0)
    return chosen[0]


def _optimize(model: nn.Module, example: tuple[Any, ...], config: JobConfig) -> nn.Module:
    try:
        from distopt.optimize import optimize
    except ImportError as err:
        raise ConfigError(f"optimize: distopt.optimize is unavailable ({err})") from None
    return optimize(model, example, config=config.optimize_config or None)


def _prediction(optimized: nn.Module) -> dict[str, float]:
    """The cost model's prediction for ``optimized``, when its optimize report carries one
    (``report.prediction``, a :class:`distopt.costmodel.Prediction`), as QPS-log header keys."""
    from distopt.report import report_of

    prediction = getattr(report_of(optimized), "prediction", None)
    if prediction is None:
        return {}
    return {"predicted_gain": prediction.speedup, "predicted_step_time_s": prediction.after_s}


def _parallelize(model: nn.Module, example: tuple[Any, ...], config: JobConfig) -> nn.Module:
    """Wrap for data parallelism; for ``optimized`` FSDP, distopt.parallelize also optimizes."""
    if config.parallel == "ddp":
        return nn.parallel.DistributedDataParallel(model)
    if config.parallel == "fsdp":
        if config.runs_optimize:
            from distopt import parallelize

            return parallelize(model, "fsdp", example_inputs=example)
        from torch.distributed.fsdp import fully_shard

        fully_shard(model)  # in place; plain FSDP2 without inner units: the baseline
        return model
    return model


def train(
    config: JobConfig,
    env: JobEnv,
    *,
    hooks: Hooks | None = None,
    header_extra: dict[str, Any] | None = None,
) -> TrainResult:
    """Train ``config.steps`` steps as trainer ``env.rank``; the trainers' gloo group (if any) must
    already be initialized. Writes this rank's QPS log and, on rank 0, checkpoints."""
    run_id = resolve_run_id(config, env)
    name = config.model_name
    torch.manual_seed(config.seed)  # identical initial parameters on every trainer
    model = models.build(name, **config.model_kwargs)
    loss_fn = models.loss_function(name, model)
    # Different data on each trainer; generated before the loop so data creation is not timed.
    batches = [
        models.make_inputs(
            name, model, config.batch_size, seed=config.seed * 100_003 + env.rank * 1009 + i
        )
        for i in range(config.data_batches)
    ]
    header = dict(header_extra or {})
    trained: nn.Module = model
    if config.runs_optimize and config.parallel != "fsdp":
        trained = _optimize(model, batches[0], config)
        header.update(_prediction(trained))
    trained = _parallelize(trained, batches[0], config)
    # After wrapping: FSDP replaces parameters by shards (the optimized module shares them).
    optimizer = torch.optim.SGD(trained.parameters(), lr=config.lr)

    checkpoint_dir = Path(config.checkpoint_dir or Path(config.output_dir) / run_id / "checkpoints")
    hooks = hooks or Hooks()
    start = 0
    if config.resume and (found := latest_checkpoint(checkpoint_dir)) is not None:
        state = load_checkpoint(found, model=model, optimizer=optimizer)
        start = int(state["step"])
        if hooks.restore_state is not None:
            hooks.restore_state(state)
        if start >= config.steps:
            raise ConfigError(
                f"resume: checkpoint {found} is at step {start}, steps is {config.steps}"
            )

    if hooks.before_loop is not None:
        hooks.before_loop()
    global_batch = config.batch_size * env.num_trainers
    saved: list[Path] = []
    loss_value = float("nan")
    progress = Progress(total=config.steps, rank=env.rank, log_every=config.log_every, start=start)
    writer = QpsLogWriter.create(
        config.output_dir,
        run_id=run_id,
        variant=config.variant,
        rank=env.rank,
        world_size=env.num_trainers,
        global_batch_size=global_batch,
        config={**to_dict(config), "run_id": run_id},
        extra={"num_ps": env.num_ps, **header},
    )
    try:
        with writer:
            for step in range(start, config.steps):
                inputs = batches[step % len(batches)]
                begin = time.perf_counter()
                optimizer.zero_grad(set_to_none=True)
                loss = loss_fn(trained(*inputs), inputs)
                loss.backward()
                if hooks.after_backward is not None:
                    hooks.after_backward(trained)
                optimizer.step()
                step_time = time.perf_counter() - begin
                loss_value = float(loss.detach())
                record = writer.log_step(step, step_time)
                progress.update(step, loss=loss_value, qps=record.qps)
                done = step + 1
                if (
                    config.checkpoint_every
                    and done % config.checkpoint_every == 0
                    and env.rank == 0
                ):
                    extra = {"run_id": run_id, "variant": config.variant}
                    if hooks.checkpoint_state is not None:
                        extra.update(hooks.checkpoint_state())
                    saved.append(
                        save_checkpoint(
                            checkpoint_dir, step=done, model=model, optimizer=optimizer, extra=extra
                        )
                    )
    finally:
        progress.close()
    return TrainResult(
        run_id=run_id,
        rank=env.rank,
        steps=config.steps - start,
        log_path=writer.path,
        final_loss=loss_value,
        checkpoints=tuple(saved),
    )
