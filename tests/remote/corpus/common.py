"""What every corpus model shares: the local tower and head, the inputs, the loss.

Each model reads two remote tables (one per server) and runs a local tower that does not depend
on them, so a scheduler that issues the reads before the tower can hide their latency.

The tower's forward (about 5 ms on one core at batch 32) is as long as the benchmark's 4 ms server
latency: in the idioms where only the tower can overlap a read (``user_async``, ``chained``) the
latency a hand-written model hides is then the whole request, not the 0.2 ms of a small tower,
which a 2-core host's noise swamped (H swung from 0.48 to 0.92 between runs).
"""

from __future__ import annotations

import torch
from torch import nn

from tests.remote.corpus.tables import DIM, NUM_ROWS

DENSE = 16
BAG = 4
SERVERS = ("ps0", "ps1")


def tower(hidden: int = 1536) -> nn.Sequential:
    return nn.Sequential(
        nn.Linear(DENSE, hidden),
        nn.ReLU(),
        nn.Linear(hidden, hidden),
        nn.ReLU(),
        nn.Linear(hidden, DIM),
    )


def head() -> nn.Linear:
    return nn.Linear(3 * DIM, 1)


def inputs(batch: int = 32, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``(dense [B, DENSE], ids [B, 2, BAG])``: one bag of ids per table."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(batch, DENSE, generator=gen), torch.randint(
        0, NUM_ROWS, (batch, 2, BAG), generator=gen
    )


def targets(batch: int = 32, seed: int = 0) -> torch.Tensor:
    return torch.rand(batch, 1, generator=torch.Generator().manual_seed(seed + 7919))


def loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.binary_cross_entropy_with_logits(out, target)


def seeded(seed: int, module: nn.Module) -> nn.Module:
    """``module`` with parameters drawn from ``seed`` (two builds with one seed are equal)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    return module
