"""``TrainPipeline``: train an optimized model with each batch's remote reads issued ahead.

Usable on its own, in the style of TorchRec's train pipelines::

    optimized = distopt.optimize(model, example)
    pipe = distopt.pipeline.TrainPipeline(
        optimized, optimizer, iter(loader), staleness=1,
        loss_fn=lambda out, batch: loss(out, batch.labels),
        inputs=lambda batch: (batch.dense, batch.sparse),
        push=lambda: distopt.ps.push_gradients(lr=0.05),
    )
    for out in pipe.run(progress=True):   # or: while True: pipe.progress()  (StopIteration at the end)
        ...

One step: take the batch in hand (its reads in flight since an earlier step), run the main stage,
then ``backward``, ``push`` and the optimizer step. With ``staleness >= 1`` the batch ``staleness``
steps ahead is prefetched before ``backward``; with ``staleness=0`` the next batch is prefetched
right after ``push``, which makes the run bitwise equal to the optimized model without a pipeline.
``staleness >= 1`` lets pushes and prefetches overtake each other, so results vary run to run
within the bound; ``deterministic=True`` keeps the issue order (repeatable, but slower).
``max_staleness`` lets the staleness deepen in the run while prefetched reads arrive late
(:class:`~distopt.pipeline.prefetch.Prefetcher`), never past it.
The job's trainer (``pipeline:`` in a job config) uses the same :class:`Prefetcher` in its loop.

Before any step, the pipeline refuses (one-line ``ConfigError`` naming the model) what it cannot
run exactly or with counted staleness: a model with no captured graph, no read to prefetch, reads
made with user RPCs running ahead of writes it cannot see (:mod:`distopt.pipeline.checks`), or a
step inside a ``dist_autograd`` context. Writes belong in the forward or in ``push``; writes made
between steps elsewhere are not seen (a ``distopt.ps`` push there is still counted).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn
from tqdm.auto import tqdm

from distopt.errors import ConfigError
from distopt.estimate.step import StepPhases
from distopt.pipeline.checks import (
    in_dist_autograd,
    no_slot_reason,
    not_captured,
    staleness_problem,
)
from distopt.pipeline.prefetch import PipelineStats, Prefetcher, check_max_staleness
from distopt.pipeline.slots import provided
from distopt.pipeline.split import PrefetchSplit, split_prefetch
from distopt.report import PipelineRecord, attach, report_of


def check_staleness(value: Any, key: str = "staleness") -> int:
    """``value`` as a staleness bound, or a one-line error naming ``key``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(f"{key}: expected an integer >= 0, got {value!r}")
    return value


def pipeline_split(model: nn.Module) -> PrefetchSplit:
    """The two stages of a model ``distopt.optimize`` captured, or a one-line error naming it."""
    name = type(model).__name__
    if not isinstance(model, torch.fx.GraphModule):
        raise ConfigError(f"pipeline: model {name} {not_captured(model)}")
    try:
        split = split_prefetch(model)
    except ValueError:
        raise ConfigError(f"pipeline: model {name} {no_slot_reason(model)}") from None
    report = report_of(model)
    if report is not None:  # explain shows both stages
        record = PipelineRecord(slots=list(split.slots), prefetch_code=split.prefetch.code)
        attach(split.main, dataclasses.replace(report, pipeline=record))
    return split


def check_pipelined(model: nn.Module, staleness: int, *, push: bool) -> PrefetchSplit:
    """The two stages of ``model`` if it can be pipelined ``staleness`` steps ahead with exact or
    counted reads (see :mod:`distopt.pipeline.checks`), else a one-line ``ConfigError`` naming it."""
    split = pipeline_split(model)
    assert isinstance(model, torch.fx.GraphModule)  # pipeline_split refused anything else
    report = report_of(model)
    problem = staleness_problem(
        model, staleness, push=push, backward_writes=report.backward_writes if report else ()
    )
    if problem is not None:
        raise ConfigError(f"pipeline: model {type(model).__name__}: {problem}")
    return split


def _default_inputs(batch: Any) -> Sequence[Any]:
    if hasattr(batch, "inputs"):
        return tuple(batch.inputs)
    return tuple(batch) if isinstance(batch, (tuple, list)) else (batch,)


@dataclasses.dataclass(frozen=True, slots=True)
class StepOutput:
    """One pipelined step: its batch, the model's output and the (detached) loss."""

    step: int
    batch: Any
    output: Any
    loss: torch.Tensor


class _Untimed:
    """The phases of a pipeline that times none (``phases=None``)."""

    def phase(self, name: str) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def backward(self, loss: torch.Tensor) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()


_UNTIMED = _Untimed()


class TrainPipeline:
    """Forward, backward, push and optimizer step with the next batches' reads in flight.

    ``phases``: time each step's phases (:class:`~distopt.estimate.step.StepPhases`, the names
    the QPS log and the cost model use); the caller takes them after each step.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        data_iter: Iterator[Any] | None = None,
        *,
        loss_fn: Callable[[Any, Any], torch.Tensor],
        staleness: int = 0,
        inputs: Callable[[Any], Sequence[Any]] = _default_inputs,
        push: Callable[[], Any] | None = None,
        to_device: Callable[[Any], Any] | None = None,
        deterministic: bool = False,
        max_staleness: int | None = None,
        phases: StepPhases | None = None,
    ) -> None:
        self.staleness = check_staleness(staleness)
        self.max_staleness = (
            None if max_staleness is None else check_staleness(max_staleness, "max_staleness")
        )
        check_max_staleness(
            self.max_staleness, staleness=self.staleness, deterministic=deterministic
        )
        self.deterministic = deterministic
        # The deepest the pipeline may go is what must be safe to run.
        self.split = check_pipelined(
            model, self.max_staleness or self.staleness, push=push is not None
        )
        self.model = self.split.main
        self.optimizer = optimizer
        self.loss_fn = loss_fn
        self.inputs = inputs
        self.push = push
        self.to_device = to_device
        self.steps = 0
        # Each step's phases, timed into the caller's StepPhases (it takes them after the step).
        self.phases = phases
        self._data_iter = data_iter
        self._prefetcher: Prefetcher[Any] | None = None

    @property
    def stats(self) -> PipelineStats:
        return self._prefetcher.stats if self._prefetcher is not None else PipelineStats()

    def _connect(self, data_iter: Iterator[Any] | None) -> Prefetcher[Any]:
        if (
            data_iter is not None
            and self._data_iter is not None
            and data_iter is not self._data_iter
        ):
            raise ConfigError(
                "TrainPipeline.progress: data_iter differs from the iterator it started with"
            )
        self._data_iter = self._data_iter or data_iter
        if self._prefetcher is None:
            if self._data_iter is None:
                raise ConfigError(
                    "TrainPipeline.progress: no data_iter (pass one here or to the constructor)"
                )
            self._prefetcher = Prefetcher(
                self.split,
                self._data_iter,
                staleness=self.staleness,
                inputs=self.inputs,
                to_device=self.to_device,
                deterministic=self.deterministic,
                max_staleness=self.max_staleness,
            )
            self._prefetcher.fill()
        return self._prefetcher

    def progress(self, data_iter: Iterator[Any] | None = None) -> StepOutput:
        """Train one step; ``StopIteration`` once the data is used up (nothing half-done)."""
        if in_dist_autograd():
            raise ConfigError(
                f"pipeline: model {type(self.model).__name__}: progress() ran inside a dist_autograd "
                "context, which TrainPipeline cannot drive (it trains with loss.backward() and push=, and "
                "would send the next batch's reads in this step's context)"
            )
        prefetcher = self._connect(data_iter)
        phases = _UNTIMED if self.phases is None else self.phases
        with phases.phase("data"):
            batch, issued = prefetcher.take()
        self.optimizer.zero_grad(set_to_none=True)
        with phases.phase("forward"):
            with provided(issued):
                output = self.model(*self.inputs(batch))
            loss = self.loss_fn(output, batch)
            # With staleness >= 1 the next batches' reads leave here: part of the forward, as in
            # the cost model's rehearsal (with 0 they leave after the push, in ``pushes``).
            prefetcher.before_backward()
        with phases.backward(loss):
            loss.backward()
        with phases.phase("pushes"):
            if self.push is not None:
                self.push()
            prefetcher.after_push()
        with phases.phase("optimizer"):
            self.optimizer.step()
        self.steps += 1
        return StepOutput(step=self.steps - 1, batch=batch, output=output, loss=loss.detach())

    def run(self, max_steps: int | None = None, *, progress: bool = False) -> Iterator[StepOutput]:
        """Steps until the data ends (or ``max_steps``); ``progress`` shows a tqdm bar with the
        loss and the measured staleness."""
        bar = None
        if progress:
            bar = tqdm(total=max_steps, unit="step", desc="pipeline")
        try:
            while max_steps is None or self.steps < max_steps:
                try:
                    out = self.progress()
                except StopIteration:
                    return
                if bar is not None:
                    bar.update(1)
                    bar.set_postfix(
                        loss=f"{float(out.loss):.4g}", stale_max=self.stats.staleness_max
                    )
                yield out
        finally:
            if bar is not None:
                bar.close()

    def close(self) -> None:
        """End the pipeline at a step boundary (safe to checkpoint the model and tables after)."""
        if self._prefetcher is not None:
            self._prefetcher.close()

    def __iter__(self) -> Iterator[StepOutput]:
        return self.run()
