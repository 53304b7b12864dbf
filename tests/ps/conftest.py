"""Fixtures of the parameter-server tests."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[None]:
    """A private Ray instance bound to loopback, no dashboard, for one test module."""
    ray = pytest.importorskip("ray")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # a loopback-only head, nothing to guard
    from distopt.ps.ray_cluster import single_host

    single_host()  # else Ray swaps 127.0.0.1 for this host's external address
    ray.init(address="local", num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1",
             log_to_driver=False)  # fmt: skip
    try:
        yield
    finally:
        ray.shutdown()
