"""A model whose forward branches on tensor values: symbolic tracing cannot capture it."""

from __future__ import annotations

from typing import cast

import torch
from torch import nn

from distopt.models import register_model


class GatedMLP(nn.Module):
    def __init__(self, features: int = 16):
        super().__init__()
        self.features = features
        self.inp = nn.Linear(features, features)
        self.pos = nn.Linear(features, features)
        self.neg = nn.Linear(features, features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.inp(x))
        if h.mean() > 0.1:  # data-dependent branch
            return self.pos(h)
        return self.neg(h) * 2


def _inputs(model: nn.Module, batch_size: int, seed: int) -> tuple[torch.Tensor]:
    features = cast(int, model.features)  # a plain int attribute of GatedMLP
    return (torch.randn(batch_size, features, generator=torch.Generator().manual_seed(seed)),)


@register_model("control_flow", inputs=_inputs)
def control_flow(features: int = 16) -> GatedMLP:
    return GatedMLP(features)
