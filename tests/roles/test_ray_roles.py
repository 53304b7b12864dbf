"""A ``distopt.train`` trainer whose servers are Ray actors: bad input fails before any step.

The jobs that train on a real Ray cluster are in ``tests/launchers/test_ray_ps_backend.py``.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from distopt.config import load_config
from distopt.dist.env import JobEnv
from distopt.dist.rendezvous import free_port
from distopt.errors import ConfigError
from distopt.roles.ps_roles import train_with_servers
from distopt.training.config import JobConfig

ray = pytest.importorskip("ray")  # imported now: its import time is no part of the bound below

TINY = Path(__file__).resolve().parents[2] / "configs" / "jobs" / "ps_dlrm_tiny.yaml"


def test_no_ray_cluster_at_the_address_fails_in_one_line_within_start_timeout(
    tmp_path: Path,
) -> None:
    port = free_port()  # closed: nothing listens there
    overrides = ["ps.backend=ray", f"ps.ray_address=127.0.0.1:{port}", "ps.start_timeout_s=2",
                 "parallel=none", f"output_dir={tmp_path}", "run_id=unreachable"]  # fmt: skip
    config = load_config(JobConfig, TINY, overrides)
    env = JobEnv(num_trainers=1, num_ps=1, ps_addr=("127.0.0.1", 1))
    started = time.monotonic()
    with pytest.raises(ConfigError) as err:
        train_with_servers(config, env)
    elapsed = time.monotonic() - started
    assert str(err.value) == (
        f"ps.ray_address: no Ray cluster reachable at 127.0.0.1:{port} within 2 s "
        "(ps.start_timeout_s): [Errno 111] Connection refused"
    )
    assert 1.9 <= elapsed < 2.0 + 1.0, elapsed  # probed until the deadline, then given up
    assert not (tmp_path / "unreachable").exists()  # no step, not even a QPS log header
    assert not ray.is_initialized()
