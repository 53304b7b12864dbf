"""Fixtures of the metrics tests."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest

from tests.metrics.synthetic import WriteRun, write_synthetic_run


@pytest.fixture
def write_run(tmp_path: Path) -> WriteRun:
    """``write_run(run_id, qps_mean, **options)``: see :func:`write_synthetic_run`."""
    return functools.partial(write_synthetic_run, tmp_path)
