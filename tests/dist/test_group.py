"""Who hosts the gloo store of a trainers-only job."""

from __future__ import annotations

import pytest

from distopt.errors import ConfigError
from distopt.dist.group import store_plan
from distopt.dist.env import JobEnv


def test_trainer_zero_hosts_on_the_master_address() -> None:
    env = JobEnv.from_environ(
        {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "10.0.0.5", "MASTER_PORT": "29500"}
    )
    plan = store_plan(env)
    assert (plan.hosted_by, plan.host, plan.gloo_port, plan.rpc_port) == (
        "trainer0",
        "10.0.0.5",
        29500,
        None,
    )


def test_a_lone_trainer_hosts_on_a_free_loopback_port() -> None:
    plan = store_plan(JobEnv.from_environ({}))
    assert (plan.hosted_by, plan.host, plan.gloo_port) == ("trainer0", "127.0.0.1", 0)


def test_several_trainers_need_the_master_address() -> None:
    with pytest.raises(
        ConfigError, match=r"^environment MASTER_ADDR/MASTER_PORT: required for 2 trainers"
    ):
        store_plan(JobEnv.from_environ({"RANK": "0", "WORLD_SIZE": "2"}))
