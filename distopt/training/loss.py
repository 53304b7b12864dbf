"""The loss a job trains and evaluates, chosen by the data's task (``DataSource.task``).

``click``: binary cross entropy of the model's logits against the labels; ``tokens``: cross
entropy of next-token logits; ``none``: the model's own loss of its outputs and inputs
(:func:`distopt.models.loss_function`). Logits are scored in fp32 whatever precision computed
them (bf16 log-softmax loses the small probabilities the loss is about).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

import torch
from torch.nn import functional as F

from distopt.data.batch import Batch
from distopt.data.config import Task
from distopt.errors import ConfigError

Reduction = Literal["mean", "sum"]
ModelLoss = Callable[[Any, tuple[Any, ...]], torch.Tensor]


def click_loss(
    logits: torch.Tensor, labels: torch.Tensor, reduction: Reduction = "mean"
) -> torch.Tensor:
    """BCE with logits over every click (``[B, 1]`` or ``[B]``)."""
    return F.binary_cross_entropy_with_logits(
        logits.float().reshape(-1), labels.float().reshape(-1), reduction=reduction
    )


def token_loss(
    logits: torch.Tensor, targets: torch.Tensor, reduction: Reduction = "mean"
) -> torch.Tensor:
    """Cross entropy of ``[B, T, V]`` logits against ``[B, T]`` next tokens."""
    flat = logits.float().reshape(-1, logits.shape[-1])
    return F.cross_entropy(flat, targets.reshape(-1), reduction=reduction)


def task_loss(task: Task, outputs: Any, batch: Batch, model_loss: ModelLoss) -> torch.Tensor:
    """The mean training loss of ``outputs`` on ``batch`` for ``task``."""
    if task == "none":
        return model_loss(outputs, batch.inputs)
    if batch.targets is None:
        raise ConfigError(f"data.task: {task} data needs targets; the batches have none")
    if task == "click":
        return click_loss(outputs, batch.targets)
    return token_loss(outputs, batch.targets)


__all__ = ["click_loss", "task_loss", "token_loss"]
