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
from distopt.errors import CaptureError, ConfigError, RemoteCallError
from distopt.estimate import predict_gain
from distopt.job import checkpoint
from distopt.job import state as job_state
from distopt.job.config import JobConfig
from distopt.job.env import JobEnv
from distopt.job.progress import Progress
from distopt.metrics.qps_log import QpsLogWriter


@dataclasses.dataclass(kw_only=True, slots=True, frozen=True)
class Hooks:
    """What a role adds to the plain training loop (the parameter-server trainer uses them all)."""

    before_loop: Callable[[], None] | None = None
    """After the model is built, optimized and parallelized (e.g. forget verification fetches)."""
    after_backward: Callable[[nn.Module], None] | None = None
    """After ``backward`` of every step (e.g. push gradients of fetched rows)."""
    before_checkpoint: Callable[[], None] | None = None
    """On every trainer before a checkpoint is cut (e.g. wait for this trainer's pushes)."""
    save_remote: Callable[[Path], None] | None = None
    """On trainer 0 while the others wait: write remote state into the checkpoint directory
    (e.g. each parameter server writes its shards)."""
    load_remote: Callable[[Path], None] | None = None
    """On trainer 0 on resume, before any trainer starts: restore remote state from a checkpoint."""


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
    """Checkpoint directories this trainer completed (trainer 0 only)."""
    resumed_from: int
    """Completed steps of the checkpoint this run resumed from (0: a fresh start)."""


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


def _prediction(model: nn.Module, optimized: nn.Module, example: tuple[Any, ...]) -> dict[str, Any]:
    """The cost model's predicted gain of ``optimized`` over ``model``, as QPS-log header keys.

    Only for parameter-server models (``model.ps_tables()``) captured as a graph; see
    :func:`distopt.estimate.predict_gain` (the forward saving taken off a measured
    forward+backward of the model as written).
    """
    if getattr(model, "ps_tables", None) is None:
        return {}
    try:
        prediction = predict_gain(model, optimized, example, measure_step=True)
    except CaptureError:
        return {}  # the prediction is optional: no graph, no prediction (never a failed job)
    return prediction.to_header()


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
    # Step s uses batch s % data_batches: the data order depends only on (seed, rank, step), so a
    # resumed run sees exactly the batches an uninterrupted one would.
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
        header.update(_prediction(model, trained, batches[0]))
    trained = _parallelize(trained, batches[0], config)
    # After wrapping: FSDP replaces parameters by shards (the optimized module shares them).
    optimizer = torch.optim.SGD(trained.parameters(), lr=config.lr)

    checkpoint_dir = Path(config.checkpoint_dir or Path(config.output_dir) / run_id / "checkpoints")
    hooks = hooks or Hooks()
    saver = job_state.trainer_state(
        model=_state_module(model, trained, optimizer),
        optimizer=optimizer,
        rank=env.rank,
        parallel=config.parallel,
        num_trainers=env.num_trainers,
        job={
            "run_id": run_id,
            "model": name,
            "seed": config.seed,
            "num_trainers": env.num_trainers,
            "num_ps": env.num_ps,
            "parallel": config.parallel,
        },
    )
    start = 0
    rng: dict[str, Any] | None = None
    resume = config.resume or env.restarts > 0  # a restarted job always continues its run
    if resume and (found := job_state.find(checkpoint_dir, saver)) is not None:
        if found.step > config.steps:
            raise ConfigError(
                f"resume: checkpoint {found.path} is at step {found.step}, steps is {config.steps}"
            )
        rng = job_state.restore(found, saver, load_remote=hooks.load_remote)["rng"]
        start = found.step

    if hooks.before_loop is not None:
        hooks.before_loop()
    if rng is not None:
        # Last, so that nothing between here and the first step (model building, optimize's
        # verification) shifts the random streams of the resumed steps.
        job_state.set_rng_state(rng)
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
                every = config.checkpoint_every
                if every and (done % every == 0 or done == config.steps):
                    cut = job_state.cut(
                        checkpoint_dir,
                        saver,
                        step=done,
                        before=hooks.before_checkpoint,
                        save_remote=hooks.save_remote,
                    )
                    if cut is not None:
                        saved.append(cut.path)
                        checkpoint.prune(checkpoint_dir, keep=config.keep_checkpoints)
    except RuntimeError as err:
        raise peer_lost(err, env) or err from None
    finally:
        progress.close()
    return TrainResult(
        run_id=run_id,
        rank=env.rank,
        steps=config.steps - start,
        log_path=writer.path,
        final_loss=loss_value,
        checkpoints=tuple(saved),
        resumed_from=start,
    )


def peer_lost(err: RuntimeError, env: JobEnv) -> RemoteCallError | None:
    """gloo's error when another trainer died mid-collective, as a one-line error naming it."""
    text = str(err)
    if "Connection closed by peer" not in text and "Connection reset by peer" not in text:
        return None
    who = f"trainer {1 - env.rank}" if env.num_trainers == 2 else "another trainer"
    first = text.strip().splitlines()[0]
    return RemoteCallError(
        f"trainer {env.rank}: {who} left the trainers' process group (exited or was killed) "
        f"during a collective: {first}"
    )


def _state_module(
    model: nn.Module, trained: nn.Module, optimizer: torch.optim.Optimizer
) -> nn.Module:
    """The module whose parameter names key the checkpoint: the model as built (so every variant
    writes the same keys), unless wrapping replaced its parameters (optimized FSDP)."""
    own = {id(p) for p in model.parameters()}
    optimized = (p for group in optimizer.param_groups for p in group["params"])
    return model if all(id(p) in own for p in optimized) else trained
