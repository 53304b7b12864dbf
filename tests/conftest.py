"""Shared test helpers."""

from __future__ import annotations

import pytest
import torch

from distopt.rendezvous import free_port

__all__ = ["free_port"]


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)
