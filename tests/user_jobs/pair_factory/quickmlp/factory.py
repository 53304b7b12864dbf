import torch
import torch.nn as nn


def make(width=64):
    model = nn.Sequential(nn.Linear(16, width), nn.GELU(), nn.Identity(), nn.Linear(width, 16))
    example = torch.randn(32, 16)
    return model, (example,)
