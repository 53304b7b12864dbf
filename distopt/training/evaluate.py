"""Evaluation on held-out data (the ``eval:`` section of a job): mean loss, AUC for click data,
perplexity for token data, over every trainer's share of the held-out set.

Each trainer evaluates its own shard (:func:`distopt.data.loader.build_eval_loader` gives every
held-out sample to exactly one trainer, unpadded). With a process group up, the loss sums and
sample counts are all-reduced and the click scores and labels are gathered, so every trainer gets
the metrics of the union: the AUC is computed over all scores (exact, ties counted half), not
averaged over ranks — an average of per-rank AUCs is not the AUC of the union.

The AUC comes from torcheval (``binary_auroc``, PyTorch's own metrics library, which depends on
torch alone). Not torchmetrics: importing it took 11 s here (it imports scipy, and transformers
when installed, for its audio and text metrics), paid by every trainer at its first evaluation;
both give the same value, ties included.

The model runs in eval mode under ``torch.no_grad`` and every module's training flag is restored
afterwards. Parameter-server models need nothing more: fetches made without grad mode are not
recorded for pushing (:mod:`distopt.ps.client.context`). A model whose forward is collective (FSDP
gathers parameters in it) needs ``lockstep``: shards differ by up to one batch, so trainers agree
before each batch whether any still has one, and a trainer that has run out repeats its last
batch uncounted until all have.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from distopt import models
from distopt.config import check
from distopt.data.batch import Batch, to_batch
from distopt.data.config import Task
from distopt.errors import ConfigError
from distopt.training.device import to_device
from distopt.training.loss import click_loss, token_loss


@dataclasses.dataclass(kw_only=True, slots=True)
class EvalConfig:
    """When and how much to evaluate."""

    every: int = 0
    """Evaluate after every ``every`` training steps (0: never during training)."""
    at_end: bool = True
    """Evaluate after the last step (when there is held-out data)."""
    max_batches: int | None = None
    """Evaluate at most this many batches per trainer; ``None``: the whole held-out shard."""
    batch_size: int | None = None
    """Held-out batch size; ``None``: the training batch size."""

    def __post_init__(self) -> None:
        check(self.every >= 0, "eval.every", "an integer >= 0", self.every)
        if self.max_batches is not None:
            check(self.max_batches >= 1, "eval.max_batches", "an integer >= 1", self.max_batches)
        if self.batch_size is not None:
            check(self.batch_size >= 1, "eval.batch_size", "an integer >= 1", self.batch_size)

    def due(self, done: int, total_steps: int) -> bool:
        """Whether to evaluate after ``done`` of ``total_steps`` steps."""
        return (self.every > 0 and done % self.every == 0) or (self.at_end and done == total_steps)


@dataclasses.dataclass(frozen=True, slots=True)
class EvalResult:
    """Metrics over all trainers' held-out shards."""

    loss: float
    """Mean loss per sample (click, none) or per predicted token (tokens)."""
    samples: int
    """Samples evaluated over all trainers (tokens: predicted tokens)."""
    auc: float | None = None
    """Area under the ROC curve of the click scores (click data)."""
    perplexity: float | None = None
    """``exp(loss)`` (token data)."""

    def as_dict(self, prefix: str = "eval_") -> dict[str, float | int]:
        """Flat metrics for logs, without the ones this task does not have."""
        fields = {
            "loss": self.loss,
            "samples": self.samples,
            "auc": self.auc,
            "perplexity": self.perplexity,
        }
        return {prefix + k: v for k, v in fields.items() if v is not None}


class _Modes:
    """Every module's training flag, to put back after evaluation."""

    def __init__(self, model: nn.Module) -> None:
        self.flags = [(m, m.training) for m in model.modules()]

    def restore(self) -> None:
        for module, training in self.flags:
            module.training = training


def _batch_size(inputs: tuple[Any, ...]) -> int:
    for value in inputs:
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            return int(value.shape[0])
    return 1


def _gather(tensor: torch.Tensor, group: Any) -> torch.Tensor:
    """Concatenation of every rank's 1-D ``tensor`` (sizes may differ), in rank order."""
    world = dist.get_world_size(group)
    size = torch.tensor([tensor.numel()], dtype=torch.int64)
    sizes = [torch.zeros_like(size) for _ in range(world)]
    dist.all_gather(sizes, size, group=group)
    longest = int(max(s.item() for s in sizes))
    padded = torch.zeros(longest, dtype=tensor.dtype)
    padded[: tensor.numel()] = tensor
    parts = [torch.zeros_like(padded) for _ in range(world)]
    dist.all_gather(parts, padded, group=group)
    return torch.cat([part[: int(n.item())] for part, n in zip(parts, sizes, strict=True)])


def _any_rank(flag: bool, group: Any, op: Any = None) -> bool:
    """``flag`` reduced over the group (MAX: any rank; MIN: every rank)."""
    value = torch.tensor([int(flag)])
    dist.all_reduce(value, op=op or dist.ReduceOp.MAX, group=group)
    return bool(value.item())


def _lockstep(batches: Iterator[Batch], group: Any) -> Iterator[tuple[Batch, bool]]:
    """``(batch, counted)`` until no rank has a batch left; a rank that ran out gets its last
    batch again, uncounted, so every rank runs the same number of forwards."""
    last = next(batches, None)
    if not _any_rank(last is not None, group, dist.ReduceOp.MIN):
        raise ConfigError(
            "eval: a trainer has no held-out batch; the held-out set needs at least "
            "one batch per trainer (more data or a smaller eval.batch_size)"
        )
    current: Batch | None = last
    while True:
        if not _any_rank(current is not None, group):
            return
        if current is None:
            assert last is not None
            yield last, False
        else:
            yield current, True
            last = current
        current = next(batches, None)


def evaluate(
    model: nn.Module,
    batches: Iterable[Any],
    *,
    task: Task,
    loss_fn: Callable[[Any, tuple[Any, ...]], torch.Tensor] | None = None,
    max_batches: int | None = None,
    device: torch.device | str | None = None,
    group: Any = None,
    host_inputs: Sequence[int] | frozenset[int] = (),
    lockstep: bool = False,
) -> EvalResult:
    """Metrics of ``model`` on held-out ``batches`` (:class:`~distopt.data.Batch` or what
    :func:`~distopt.data.batch.to_batch` accepts), all-reduced over ``group`` (default: the
    default process group) when one is initialized. ``loss_fn(outputs, inputs)`` scores ``none``
    data (default :func:`distopt.models.default_loss`). Inputs at ``host_inputs`` stay on the
    host; ``lockstep`` for models whose forward is collective (see the module docstring). Every
    rank of the group must call this."""
    if device is None:
        first = next(model.parameters(), None)
        device = first.device if first is not None else torch.device("cpu")
    device = torch.device(device)
    distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1
    loss_sum, count = 0.0, 0
    scores: list[torch.Tensor] = []
    labels: list[torch.Tensor] = []
    chosen = (to_batch(raw) for raw in itertools.islice(batches, max_batches))
    steps = _lockstep(chosen, group) if lockstep and distributed else ((b, True) for b in chosen)
    modes = _Modes(model)
    model.eval()
    try:
        with torch.no_grad():
            for host_batch, counted in steps:
                batch: Batch = to_device(host_batch, device, keep=host_inputs)
                inputs = batch.inputs
                outputs = model(*inputs)
                if not counted:
                    continue
                if task == "none":
                    n = _batch_size(inputs)
                    loss = (loss_fn or models.default_loss)(outputs, inputs)
                    loss_sum, count = loss_sum + float(loss) * n, count + n
                    continue
                if batch.targets is None:
                    raise ConfigError(
                        f"data.task: {task} evaluation needs targets; the held-out "
                        "batches have none"
                    )
                targets = batch.targets
                if task == "click":
                    loss_sum += float(click_loss(outputs, targets, reduction="sum"))
                    count += targets.numel()
                    scores.append(torch.sigmoid(outputs.float().reshape(-1)).cpu())
                    labels.append(targets.float().reshape(-1).cpu())
                else:
                    loss_sum += float(token_loss(outputs, targets, reduction="sum"))
                    count += targets.numel()
    finally:
        modes.restore()
    if distributed:
        totals = torch.tensor([loss_sum, float(count)], dtype=torch.float64)
        dist.all_reduce(totals, group=group)
        loss_sum, count = float(totals[0]), int(totals[1])
    mean = loss_sum / count if count else math.nan
    if task == "tokens":
        return EvalResult(
            loss=mean, samples=count, perplexity=math.exp(mean) if count else math.nan
        )
    if task == "none":
        return EvalResult(loss=mean, samples=count)
    all_scores = torch.cat(scores) if scores else torch.zeros(0)
    all_labels = torch.cat(labels) if labels else torch.zeros(0)
    if distributed:
        all_scores, all_labels = _gather(all_scores, group), _gather(all_labels, group)
    return EvalResult(loss=mean, samples=count, auc=auc(all_scores, all_labels))


def auc(scores: torch.Tensor, labels: torch.Tensor) -> float:
    """Exact ROC AUC (torcheval); NaN when the labels are all one class or there are none."""
    if labels.numel() == 0 or bool((labels == labels[0]).all()):
        return math.nan
    # torcheval takes 0.13 s to import (only jobs that evaluate need it), and 0.0.7 decorates
    # helpers with torch.jit.script, which warns.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        from torcheval.metrics.functional import binary_auroc

    return float(binary_auroc(scores.double(), labels.double()))


__all__ = ["EvalConfig", "EvalResult", "auc", "evaluate"]
