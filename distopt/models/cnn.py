"""A small conv net with BatchNorm (exercises buffers, train/eval modes and conv-bn folding)."""

from __future__ import annotations

from typing import cast

import torch
from torch import nn

from distopt.models import register_model


class SmallCNN(nn.Module):
    def __init__(self, channels: int = 8, num_classes: int = 10, image_size: int = 16):
        super().__init__()
        self.image_size = image_size
        self.features = nn.Sequential(
            nn.Conv2d(3, channels, 3, padding=1, bias=False),
            nn.BatchNorm2d(channels),
            nn.ReLU(),
            nn.Conv2d(channels, channels * 2, 3, stride=2, padding=1),
            nn.BatchNorm2d(channels * 2),
            nn.ReLU(),
        )
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.classifier = nn.Linear(channels * 2, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool(self.features(x))
        return self.classifier(torch.flatten(x, 1))


def _inputs(model: nn.Module, batch_size: int, seed: int) -> tuple[torch.Tensor]:
    size = cast(int, model.image_size)  # a plain int attribute of SmallCNN
    return (torch.randn(batch_size, 3, size, size, generator=torch.Generator().manual_seed(seed)),)


@register_model("cnn", inputs=_inputs)
def cnn(channels: int = 8, num_classes: int = 10, image_size: int = 16) -> SmallCNN:
    return SmallCNN(channels, num_classes, image_size)
