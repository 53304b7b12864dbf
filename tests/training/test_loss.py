"""The task losses: BCE for clicks, cross entropy for tokens (in fp32), the model's own otherwise."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from distopt.data import Batch
from distopt.errors import ConfigError
from distopt.training.loss import task_loss


def test_click_and_token_losses() -> None:
    logits, labels = torch.randn(4, 1), torch.tensor([[1.0], [0.0], [1.0], [0.0]])
    batch = Batch((torch.zeros(4),), labels)
    torch.testing.assert_close(
        task_loss("click", logits, batch, None),  # type: ignore[arg-type]
        F.binary_cross_entropy_with_logits(logits, labels),
    )
    vocab = torch.randn(2, 3, 5, dtype=torch.bfloat16)
    targets = torch.randint(0, 5, (2, 3))
    loss = task_loss("tokens", vocab, Batch((targets,), targets), None)  # type: ignore[arg-type]
    assert loss.dtype == torch.float32
    torch.testing.assert_close(
        loss, F.cross_entropy(vocab.float().reshape(6, 5), targets.reshape(6))
    )


def test_none_uses_the_model_loss_and_targets_are_required_otherwise() -> None:
    out = torch.ones(3)
    assert task_loss("none", out, Batch((out,), None), lambda o, i: o.sum()) == 3
    with pytest.raises(ConfigError, match="click data needs targets"):
        task_loss("click", out, Batch((out,), None), lambda o, i: o.sum())
