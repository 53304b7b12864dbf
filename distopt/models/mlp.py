"""A plain MLP, and a deep variant used to measure optimize() overhead on large graphs."""

from __future__ import annotations

from typing import cast

import torch
from torch import nn

from distopt.models import register_model


class MLP(nn.Module):
    def __init__(
        self, in_features: int = 32, hidden: int = 64, depth: int = 3, out_features: int = 10
    ):
        super().__init__()
        layers: list[nn.Module] = []
        width = in_features
        for _ in range(depth):
            layers += [nn.Linear(width, hidden), nn.ReLU()]
            width = hidden
        self.body = nn.Sequential(*layers)
        self.head = nn.Linear(width, out_features)
        self.in_features = in_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


def _inputs(model: nn.Module, batch_size: int, seed: int) -> tuple[torch.Tensor]:
    in_features = cast(int, model.in_features)  # a plain int attribute of MLP
    return (torch.randn(batch_size, in_features, generator=torch.Generator().manual_seed(seed)),)


@register_model("mlp", inputs=_inputs)
def mlp(in_features: int = 32, hidden: int = 64, depth: int = 3, out_features: int = 10) -> MLP:
    return MLP(in_features, hidden, depth, out_features)
