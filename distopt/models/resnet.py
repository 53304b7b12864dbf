"""A ResNet-50-shaped CNN: a 7×7 stem, then bottleneck stages of [3, 4, 6, 3] blocks.

``width=64, image_size=224`` is ResNet-50 (25.6M parameters); tests and CPU benchmarks shrink the
width and the image. Written from the paper's description (He et al., 2015, table 1), with the
stride on the 3×3 convolution ("ResNet v1.5").
"""

from __future__ import annotations

from typing import cast

import torch
from torch import nn

from distopt.models import register_model


class Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, in_channels: int, width: int, stride: int = 1):
        super().__init__()
        out_channels = width * self.expansion
        self.conv1 = nn.Conv2d(in_channels, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, out_channels, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(out_channels)
        self.relu = nn.ReLU(inplace=True)
        self.downsample: nn.Module | None = None
        if stride != 1 or in_channels != out_channels:
            self.downsample = nn.Sequential(
                nn.Conv2d(in_channels, out_channels, 1, stride=stride, bias=False),
                nn.BatchNorm2d(out_channels),
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return self.relu(out + identity)


class ResNet(nn.Module):
    def __init__(
        self,
        blocks: tuple[int, ...] = (3, 4, 6, 3),
        width: int = 64,
        num_classes: int = 1000,
        image_size: int = 224,
    ):
        super().__init__()
        self.image_size = image_size
        self.conv1 = nn.Conv2d(3, width, 7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, stride=2, padding=1)
        channels = width
        stages = []
        for i, count in enumerate(blocks):
            stage_width = width * 2**i
            layers = []
            for j in range(count):
                stride = 2 if (i > 0 and j == 0) else 1
                layers.append(Bottleneck(channels, stage_width, stride))
                channels = stage_width * Bottleneck.expansion
            stages.append(nn.Sequential(*layers))
        self.layer1, self.layer2, self.layer3, self.layer4 = (stages + [nn.Identity()] * 4)[:4]
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(channels, num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def _inputs(model: nn.Module, batch_size: int, seed: int) -> tuple[torch.Tensor]:
    size = cast(int, model.image_size)  # a plain int attribute of ResNet
    return (torch.randn(batch_size, 3, size, size, generator=torch.Generator().manual_seed(seed)),)


@register_model("resnet50", inputs=_inputs)
def resnet50(
    width: int = 64,
    num_classes: int = 1000,
    image_size: int = 224,
    blocks: tuple[int, ...] = (3, 4, 6, 3),
) -> ResNet:
    return ResNet(tuple(blocks), width, num_classes, image_size)
