"""Who hosts what in a ``distopt.train`` job with parameter servers (the TorchX roles)."""

from __future__ import annotations

import pytest

from distopt.dist.env import JobEnv
from distopt.errors import ConfigError
from distopt.ps.spec import ServerOptions
from distopt.roles.ps_roles import serve
from distopt.roles.ps_setup import server_options, store_plan
from distopt.training.config import JobConfig

_ENV = {
    "DISTOPT_NUM_PS": "2",
    "DISTOPT_NUM_TRAINERS": "2",
    "DISTOPT_PS_ADDR": "localhost:4000",
    "DISTOPT_DDP_PORT": "4001",
    "REPLICA_ID": "1",
}


@pytest.mark.parametrize("role", ["ps", "trainer"])
def test_server_zero_hosts_both_stores_on_the_ps_address(role: str) -> None:
    env = JobEnv.from_environ({**_ENV, "DISTOPT_ROLE": role})
    plan = store_plan(env, server_options(JobConfig(model="mlp"), env))
    assert (plan.hosted_by, plan.host, plan.rpc_port, plan.gloo_port) == (
        "ps0",
        "127.0.0.1",
        4000,
        4001,
    )


def test_without_a_ddp_port_the_plan_has_no_gloo_store() -> None:
    env = JobEnv.from_environ({**_ENV, "DISTOPT_DDP_PORT": "", "DISTOPT_ROLE": "ps"})
    assert store_plan(env, server_options(JobConfig(model="mlp"), env)).gloo_port is None


def test_a_ps_process_of_a_ray_job_is_refused() -> None:
    env = JobEnv.from_environ({**_ENV, "DISTOPT_ROLE": "ps"})
    config = JobConfig(model="mlp", ps=ServerOptions(backend="ray"))
    with pytest.raises(ConfigError) as err:
        serve(config, env)
    assert str(err.value) == (
        "ps.backend: 'ray' jobs have no ps processes (trainer 0 creates the server actors), yet this "
        "is ps 1: launch the job with distopt.ps_job or distopt launch"
    )
