"""The trainer role: build the model and its data, optionally optimize and parallelize the model,
train with the configured optimizer, evaluate on held-out data, checkpoint, and record it all.

One step is ``optim.accumulate_steps`` micro-batches and one optimizer update. Its time, from the
end of the previous step's bookkeeping to the update done (on CUDA, synchronized), includes
waiting for the batch: a loader that cannot keep up shows as lower QPS. Evaluations and
checkpoints are timed on their own and are in no step's time.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
import secrets
import statistics
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.fx
from torch import nn
from torch.utils._pytree import tree_leaves

import distopt.ps as ps
from distopt import models
from distopt.config import to_dict
from distopt.data import Batch, DataSource, build_data, to_batch
from distopt.dist.env import JobEnv
from distopt.dist.rendezvous import collective, collective_error
from distopt.errors import CaptureError, ConfigError, DistoptFallbackWarning, RemoteCallError
from distopt.estimate.step import (
    StepPhases,
    gradient_bytes,
)
from distopt.metrics.qps_log import QpsLogWriter
from distopt.metrics.records import log_path
from distopt.optimize import optimize
from distopt.optimize.explain import summary
from distopt.optimize.gain import Lockstep, predict_gain, read_ahead, step_of
from distopt.parallel import apply_fsdp, parallelize
from distopt.pipeline import Prefetcher, check_pipelined, provided
from distopt.ps.client import calls as ps_calls
from distopt.remote.ops import remote_ops
from distopt.training import checkpoint
from distopt.training import device as job_device
from distopt.training import state as job_state
from distopt.training.config import JobConfig
from distopt.training.evaluate import EvalResult, evaluate
from distopt.training.loss import task_loss
from distopt.training.optim import Stepper, build_optimizer
from distopt.training.progress import Progress
from distopt.training.recovery import Agreement
from distopt.training.telemetry import Recorder, reopen_log, tensorboard_writer

logger = logging.getLogger(__name__)


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
    recover: Callable[[checkpoint.Checkpoint | None], None] | None = None
    """On every trainer re-entering :func:`train` after a rollback, before anything else calls the
    remote side: bring it back to a checkpoint (``None``: its initial state) (see
    :mod:`distopt.training.recovery`)."""


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
    evaluation: EvalResult | None = None
    """The last held-out evaluation (``None``: no held-out data or none due)."""


def resolve_run_id(config: JobConfig, env: JobEnv) -> str:
    """Config, then ``$DISTOPT_RUN_ID``, then an id chosen by trainer 0 and shared over gloo."""
    if config.run_id is not None:
        return config.run_id
    if env.run_id is not None:
        return env.run_id
    chosen = [f"{config.variant}-{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(3)}"]
    if dist.is_initialized() and dist.get_world_size() > 1:
        with collective("the run id chosen by trainer 0", me=f"trainer {env.rank}"):
            dist.broadcast_object_list(chosen, src=0)
    return chosen[0]


def _optimize(model: nn.Module, example: tuple[Any, ...], config: JobConfig) -> nn.Module:
    with warnings.catch_warnings():
        # The job logs the summary line (explain.summary), which gives the reason: the warning
        # would say it again, naming this file as its cause.
        warnings.simplefilter("ignore", DistoptFallbackWarning)
        return optimize(model, example, config=config.optimize_config or None)


def _batch_bytes(batch: Batch) -> int:
    return sum(t.nbytes for t in tree_leaves(batch.inputs) if isinstance(t, torch.Tensor))


def _prediction(
    model: nn.Module,
    optimized: nn.Module,
    batches_of: Callable[[], tuple[list[tuple[Any, ...]], float]],
    staleness: int | None,
    *,
    config: JobConfig,
) -> dict[str, Any]:
    """The cost model's predicted gain of ``optimized`` over ``model``, as QPS-log header keys.

    Only for models captured as a graph that makes remote calls, whatever serves them (distopt's
    tables, the user's own functions, RRefs, Ray actors); see
    :func:`distopt.optimize.gain.predict_gain`: steps of both models rehearsed on the job's first
    batches in turn (``batches_of()``: inputs on the device, the first is the example, and the
    loader's part of taking a batch; read only when the prediction rehearses) by every trainer
    together, each step ending as the job's do (the DDP all-reduce; pushes in turn in
    deterministic jobs), and the whole step phase by phase (:mod:`distopt.estimate.step`).
    Every trainer calls this.
    """
    remote = isinstance(optimized, torch.fx.GraphModule) and bool(remote_ops(optimized.graph))
    lockstep = None
    if dist.is_initialized() and dist.get_world_size() > 1:
        ddp = config.parallel == "ddp"
        lockstep = Lockstep(gradient_bytes=gradient_bytes(model) if ddp else 0)
        # Every trainer rehearses or none: one that did not would leave the others waiting in
        # the rehearsal's collectives until the group's timeout.
        remote = lockstep.agree(remote)
    if not remote:
        return {}
    batches, data_s = batches_of()
    in_turn = config.deterministic and ps_calls.is_connected()
    try:
        prediction = predict_gain(
            model,
            optimized,
            batches[0],
            measure_step=True,
            pipeline_staleness=staleness,
            repeats=PREDICTION_REPEATS,
            pushes="in_turn" if in_turn else "async",
            lockstep=lockstep,
            optimizer=lambda params: build_optimizer(params, config.optim),
            batches=batches,
            data_s=data_s,
        )
    except CaptureError:
        return {}  # the prediction is optional: no graph, no prediction (never a failed job)
    except Exception as err:  # the user's model or servers failed before any training step
        raise RuntimeError(
            "the optimized variant's start-up rehearsal (training steps on the first batches, "
            "timed to predict the gain: docs/cost_model.md) failed: "
            f"{type(err).__name__}: {err}"
        ) from err
    if prediction.unmeasured_step is not None:
        logger.info("prediction: no step time predicted: %s", prediction.unmeasured_step)
    header = prediction.to_header()
    step = step_of(prediction)
    if step is not None:
        header.update(step.to_header())
    return header


def _timed(stream: Iterator[Batch], seconds: list[float]) -> Iterator[Batch]:
    """``stream``, appending the seconds each item took to read to ``seconds``."""
    while True:
        start_s = time.perf_counter()
        try:
            item = next(stream)
        except StopIteration:
            return
        seconds.append(time.perf_counter() - start_s)
        yield item


PREDICTION_REPEATS = 15
"""Timed runs of each graph, and rehearsed steps of each schedule, the prediction takes the
median of: enough that two runs of one job predict alike on a busy host (docs/cost_model.md)."""


def _parallelize(
    model: nn.Module,
    example: tuple[Any, ...],
    config: JobConfig,
    *,
    device: torch.device,
    group: Any,
) -> nn.Module:
    """Wrap for data parallelism; for ``optimized`` FSDP, distopt.parallelize also optimizes."""
    if config.parallel == "ddp":
        ids = [device.index] if device.type == "cuda" else None
        return nn.parallel.DistributedDataParallel(model, device_ids=ids, process_group=group)
    if config.parallel == "fsdp":
        mesh = job_device.device_mesh(device, group)
        if config.runs_optimize:
            dtypes: dict[str, Any] = {"param_dtype": "bfloat16", "reduce_dtype": "float32"}
            return parallelize(
                model,
                "fsdp",
                example_inputs=example,
                mesh=mesh,
                config=dtypes if config.precision == "bf16" else None,
            )
        # Plain FSDP2 without inner units: the baseline.
        return apply_fsdp(
            model, [], mesh=mesh, mp_policy=job_device.mixed_precision(config.precision)
        )
    return model


def _gradient_sync(module: nn.Module, enabled: bool) -> contextlib.AbstractContextManager[Any]:
    """Skip the gradient all-reduce of a micro-batch that is not the last of its step."""
    if isinstance(module, nn.parallel.DistributedDataParallel):
        return contextlib.nullcontext() if enabled else module.no_sync()
    set_sync = getattr(module, "set_requires_gradient_sync", None)  # FSDP2
    if callable(set_sync):
        set_sync(enabled)
    return contextlib.nullcontext()


def _job_shape(config: JobConfig, env: JobEnv, run_id: str, name: str) -> dict[str, Any]:
    return {
        "run_id": run_id,
        "model": name,
        "seed": config.seed,
        "num_trainers": env.num_trainers,
        "num_ps": env.num_ps,
        "parallel": config.parallel,
    }


def _recorder(
    config: JobConfig,
    env: JobEnv,
    run_id: str,
    header: dict[str, Any],
    start: int,
    recoveries: list[dict[str, Any]],
) -> Recorder:
    """A new QPS log; after a recovery (``recoveries``), the run's log back to step ``start``."""
    global_batch = config.batch_size * config.optim.accumulate_steps * env.num_trainers
    board = None
    if config.tensorboard and env.rank == 0:
        board = tensorboard_writer(Path(config.output_dir) / run_id / "tensorboard")
    if recoveries:
        log = reopen_log(log_path(config.output_dir, run_id, env.rank), before_step=start)
        log.footer["recoveries"] = list(recoveries)
    else:
        log = QpsLogWriter.create(
            config.output_dir,
            run_id=run_id,
            variant=config.variant,
            rank=env.rank,
            world_size=env.num_trainers,
            global_batch_size=global_batch,
            config={**to_dict(config), "run_id": run_id},
            extra={"num_ps": env.num_ps, **header},
        )
    progress = Progress(total=config.steps, rank=env.rank, log_every=config.log_every, start=start)
    return Recorder(log, progress, board)


def train(
    config: JobConfig,
    env: JobEnv,
    *,
    hooks: Hooks | None = None,
    header_extra: dict[str, Any] | None = None,
    source: DataSource | None = None,
    agreement: Agreement | None = None,
) -> TrainResult:
    """Train ``config.steps`` steps as trainer ``env.rank``; the trainers' gloo group (if any) must
    already be initialized. Writes this rank's QPS log and, on rank 0, checkpoints and TensorBoard
    events. ``source`` replaces the config's data (benchmarks). ``agreement``: where the trainers
    agree to roll back, and the rollback this call recovers from (:mod:`distopt.training.recovery`)."""
    run_id = resolve_run_id(config, env)
    device = job_device.resolve_device(config.device, local_rank=env.local_rank)
    name = config.model_name
    torch.manual_seed(config.seed)  # identical initial parameters on every trainer
    model = models.build(name, **config.model_kwargs)
    tables = getattr(model, "ps_tables", None)
    if not ps_calls.is_connected() and callable(tables) and tables():
        raise ConfigError(
            f"model: {name!r} has parameter-server tables (ps_tables()), and this process has no "
            "servers: launch the job with `distopt launch` (it starts them), or run it as the "
            "distopt.ps_job component does (DISTOPT_NUM_PS and a ps role)"
        )
    model_loss = models.loss_function(name, model)
    source = source or build_data(
        config.data, model_name=name, model=model, batch_size=config.batch_size, seed=config.seed
    )
    keep = job_device.host_inputs(model)
    model.to(device)
    if ps_calls.is_connected():
        ps.set_device(device)  # fetched rows land next to the dense parameters

    checkpoint_dir = Path(config.checkpoint_dir or Path(config.output_dir) / run_id / "checkpoints")
    hooks = hooks or Hooks()
    job = _job_shape(config, env, run_id, name)
    found = None
    agree = agreement or Agreement(enabled=False)
    recovering = agree.rollback is not None
    if config.resume or env.restarts > 0 or recovering:  # a restarted job always continues its run
        found = job_state.find(checkpoint_dir, rank=env.rank, job=job)
    if recovering and hooks.recover is not None:
        hooks.recover(found)  # before optimize's verification fetches
    if found is not None and found.step > config.steps:
        raise ConfigError(
            f"resume: checkpoint {found.path} is at step {found.step}, steps is {config.steps}"
        )
    start = found.step if found is not None else 0
    accumulate = config.optim.accumulate_steps
    # The data position is the micro-batch count: a resumed run reads what an uninterrupted one
    # would from here on. The first batch is also the example optimize/parallelize trace with.
    loader = source.train_loader(
        rank=env.rank, world_size=env.num_trainers, batch_size=config.batch_size, seed=config.seed
    )
    stream = (to_batch(b) for b in loader.batches(start * accumulate))
    first = next(stream)
    example = job_device.to_device(first, device, keep=keep).inputs
    ahead: list[Batch] = []

    header = dict(header_extra or {})
    trained: nn.Module = model
    optimized = None
    if config.runs_optimize and config.parallel != "fsdp":
        trained = optimized = _optimize(model, example, config)
        staleness = config.pipeline.staleness if config.pipeline.enabled else None

        def rehearsal_batches() -> tuple[list[tuple[Any, ...]], float]:
            """The cost model's rehearsal takes the job's first batches in turn, as its steps
            will (their device copies are dropped with it), and the loader's part of taking
            one: read only for a rehearsal."""
            reads: list[float] = []
            # No more than the job's own steps take after the first batch.
            left = (config.steps - start) * accumulate - 1
            ahead[:], fit = read_ahead(_timed(stream, reads), _batch_bytes, most=left)
            rehearsed = [example]
            for i, batch in enumerate(ahead[:fit]):
                start_s = time.perf_counter()
                rehearsed.append(job_device.to_device(batch, device, keep=keep).inputs)
                reads[i] += time.perf_counter() - start_s
            # A loader without workers reads each batch inside the step; workers read ahead.
            no_workers = fit > 0 and config.data.num_workers == 0
            return rehearsed, statistics.median(reads[:fit]) * accumulate if no_workers else 0.0

        header.update(_prediction(model, trained, rehearsal_batches, staleness, config=config))
    batches: Iterator[Batch] = itertools.chain([first], ahead, stream)
    prefetcher = None
    if config.pipeline.enabled:
        # Split before DDP wraps it: DDP runs the main stage, which shares the parameters. The
        # job's only writes outside the graph are distopt.ps pushes, which staleness counts.
        deepest = config.pipeline.max_staleness or config.pipeline.staleness
        split = check_pipelined(trained, deepest, push=False)
        trained = split.main
        prefetcher = Prefetcher(
            split,
            batches,
            staleness=config.pipeline.staleness,
            inputs=lambda b: b.inputs,
            deterministic=config.deterministic,
            to_device=lambda b: job_device.to_device(b, device, keep=keep),
            max_staleness=config.pipeline.max_staleness,
        )
    group = job_device.data_parallel_group(device)
    trained = _parallelize(trained, example, config, device=device, group=group)
    # After wrapping: FSDP replaces parameters by shards (the optimized module shares them).
    stepper = Stepper(trained.parameters(), config.optim, total_steps=config.steps)
    saver = job_state.trainer_state(
        model=_state_module(model, trained, stepper.optimizer),
        optimizer=stepper.optimizer,
        rank=env.rank,
        parallel=config.parallel,
        num_trainers=env.num_trainers,
        job=job,
    )
    rng: dict[str, Any] | None = None
    if found is not None:
        saved = job_state.restore(
            found, saver, load_remote=None if recovering else hooks.load_remote
        )
        stepper.scheduler.load_state_dict(saved["scheduler"])
        rng = saved["rng"]

    if hooks.before_loop is not None:
        hooks.before_loop()
    if optimized is not None and env.rank == 0:
        logger.info("%s", summary(optimized))  # what trains: optimized, verified or why not
    ps.take_wait_time()  # waits so far (verification, prediction) belong to no step
    ps_calls.take_fetch_counts()  # and so do their fetches
    if rng is not None:
        # Last, so that nothing between here and the first step (model building, optimize's
        # verification) shifts the random streams of the resumed steps.
        job_state.set_rng_state(rng)
    eval_model = (
        trained.module if isinstance(trained, nn.parallel.DistributedDataParallel) else trained
    )
    eval_loader = source.eval_loader(
        rank=env.rank,
        world_size=env.num_trainers,
        batch_size=config.eval.batch_size or config.batch_size,
    )
    waits = ps_calls.is_connected()
    phases = StepPhases(ps.take_wait_time if waits else None)
    saved_paths: list[Path] = []
    loss_value = float("nan")
    evaluation: EvalResult | None = None
    recorder = _recorder(config, env, run_id, header, start, agree.history)
    if prefetcher is not None:
        prefetcher.fill()  # the first batches' reads, before the first step's clock starts
    try:
        with recorder:
            tick = time.perf_counter()
            for step in range(start, config.steps):
                losses = []
                lr = stepper.lr  # the rate this step's update uses
                agree.step = step
                for micro in range(accumulate):
                    with _gradient_sync(trained, micro == accumulate - 1):
                        with (
                            agree.agreed()
                        ):  # before backward: no trainer enters DDP's all-reduce alone
                            issued = None
                            with phases.phase("data"):
                                if prefetcher is not None:
                                    batch, issued = prefetcher.take()
                                else:
                                    batch = job_device.to_device(next(batches), device, keep=keep)
                            with (
                                phases.phase("forward"),
                                job_device.autocast(device, config.precision),
                                provided(issued),
                            ):
                                loss = task_loss(
                                    source.task, trained(*batch.inputs), batch, model_loss
                                )
                        if prefetcher is not None:
                            # Staleness >= 1: the next reads leave here (rehearsed in forward).
                            with phases.phase("forward"):
                                prefetcher.before_backward()
                        scaled = stepper.scale(loss)
                        with phases.backward(scaled):
                            scaled.backward()
                    with phases.phase("pushes"):
                        if hooks.after_backward is not None:
                            hooks.after_backward(trained)
                        if prefetcher is not None:
                            prefetcher.after_push()
                    losses.append(loss.detach())
                    with phases.phase("optimizer"):
                        stepper.step(step * accumulate + micro)
                loss_value = float(torch.stack(losses).float().mean())
                job_device.synchronize(device)
                step_time = time.perf_counter() - tick
                recorder.step(
                    step,
                    step_time,
                    loss=loss_value,
                    lr=lr,
                    wait_s=phases.take_waited() if waits else None,
                    pipeline=prefetcher.stats if prefetcher is not None else None,
                    phases=phases.take(),
                    fetched=ps_calls.take_fetch_counts() if waits else None,
                    cached=bool(config.ps.cache),
                )
                done = step + 1
                if eval_loader is not None and config.eval.due(done, config.steps):
                    began = time.perf_counter()
                    with job_device.autocast(device, config.precision), agree.agreed():
                        evaluation = evaluate(
                            eval_model,
                            eval_loader,
                            task=source.task,
                            loss_fn=model_loss,
                            max_batches=config.eval.max_batches,
                            device=device,
                            host_inputs=keep,
                            lockstep=config.parallel == "fsdp",
                        )
                    recorder.evaluation(done, evaluation, time.perf_counter() - began)
                    ps.take_wait_time()
                    ps_calls.take_fetch_counts()  # the evaluation's fetches are no step's
                every = config.checkpoint_every
                if every and (done % every == 0 or done == config.steps):
                    cut = job_state.cut(
                        checkpoint_dir,
                        saver,
                        step=done,
                        extra={
                            "scheduler": stepper.scheduler.state_dict(),
                            "data": {"micro_batches": done * accumulate},
                        },
                        before=hooks.before_checkpoint,
                        check=agree.settle,
                        save_remote=hooks.save_remote and agree.deferring(hooks.save_remote),
                    )
                    if cut is not None:
                        saved_paths.append(cut.path)
                        checkpoint.prune(checkpoint_dir, keep=config.keep_checkpoints)
                tick = time.perf_counter()
    except RuntimeError as err:
        raise peer_lost(err, env, step=agree.step) or err from None
    finally:
        if prefetcher is not None:
            prefetcher.close()
    return TrainResult(
        run_id=run_id,
        rank=env.rank,
        steps=config.steps - start,
        log_path=recorder.path,
        final_loss=loss_value,
        checkpoints=tuple(saved_paths),
        resumed_from=start,
        evaluation=evaluation,
    )


def peer_lost(err: RuntimeError, env: JobEnv, *, step: int | None = None) -> RemoteCallError | None:
    """gloo's error when another trainer died mid-collective, or did not reach it within the
    trainers' group timeout, as a one-line error naming it (``None``: another error)."""
    who = f"trainer {1 - env.rank}" if env.num_trainers == 2 else "another trainer"
    if env.num_trainers == 2 and len(env.hosts) == 2 and len(set(env.hosts)) == 2:
        who += f" (on {env.hosts[1 - env.rank]})"  # a job across hosts: which host was lost
    at = f" at step {step + 1}" if step is not None else ""
    named = collective_error(
        err, f"a collective of the training loop{at}", me=f"trainer {env.rank}", peers="trainers"
    )
    if named is None:
        return None
    text = str(err)
    first = text.strip().splitlines()[0]
    if "Connection closed by peer" in text or "Connection reset by peer" in text:
        return RemoteCallError(
            f"trainer {env.rank}: {who} left the trainers' process group (exited or was killed) "
            f"during a collective{at}: {first}"
        )
    if "timed out waiting for" in str(named):
        return RemoteCallError(
            f"trainer {env.rank}: {who} did not reach a collective{at} within "
            f"collective_timeout_s (its host died, hangs or lost its link): {first}"
        )
    return named


def _state_module(
    model: nn.Module, trained: nn.Module, optimizer: torch.optim.Optimizer
) -> nn.Module:
    """The module whose parameter names key the checkpoint: the model as built (so every variant
    writes the same keys), unless wrapping replaced its parameters (optimized FSDP)."""
    own = {id(p) for p in model.parameters()}
    optimized = (p for group in optimizer.param_groups for p in group["params"])
    return model if all(id(p) in own for p in optimized) else trained
