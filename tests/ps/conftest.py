"""Fixtures of the parameter-server tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[None]:
    """A private Ray instance bound to loopback, no dashboard, for one test module."""
    ray = pytest.importorskip("ray")
    from distopt.ps.cluster.ray_backend import ensure_ray
    from distopt.ps.spec import ServerOptions

    ensure_ray("local", ServerOptions(backend="ray"))  # as a job's private instance: on 127.0.0.1
    try:
        yield
    finally:
        ray.shutdown()
