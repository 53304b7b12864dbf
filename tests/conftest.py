"""Shared test helpers."""

from __future__ import annotations

import socket

import pytest
import torch


def free_port() -> int:
    """A free TCP port on 127.0.0.1 (bind port 0, read it back)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)
