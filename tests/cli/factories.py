"""Model factories used by the CLI tests (``distopt explain tests.cli.factories:tiny``)."""

import torch
from torch import nn


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x).tanh()


def tiny() -> tuple[nn.Module, torch.Tensor]:
    return Tiny(), torch.randn(4, 3)
