"""Reading the process's place in the job from the launcher's environment."""

from __future__ import annotations

import pytest

from distopt.errors import ConfigError
from distopt.dist.env import JobEnv


def test_lone_process_is_trainer_zero_of_one() -> None:
    env = JobEnv.from_environ({})
    assert (env.role, env.rank, env.num_trainers, env.num_ps) == ("trainer", 0, 1, 0)
    assert env.master_addr is None and env.ps_addr is None and env.run_id is None


def test_torchrun_variables() -> None:
    env = JobEnv.from_environ(
        {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "MASTER_ADDR": "127.0.0.1",
         "MASTER_PORT": "29500", "REPLICA_ID": "0", "DISTOPT_RUN_ID": "r7"}
    )  # fmt: skip
    assert (env.rank, env.num_trainers, env.local_rank) == (1, 2, 1)
    assert (env.master_addr, env.master_port, env.run_id) == ("127.0.0.1", 29500, "r7")


def test_ps_job_variables_from_the_torchx_component() -> None:
    common = {
        "DISTOPT_NUM_PS": "2", "DISTOPT_NUM_TRAINERS": "3", "WORLD_SIZE": "5",
        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "4000", "DISTOPT_PS_ADDR": "127.0.0.1:4000",
        "DISTOPT_DDP_PORT": "4001",
    }  # fmt: skip
    trainer = JobEnv.from_environ(
        {**common, "DISTOPT_ROLE": "trainer", "REPLICA_ID": "2", "RANK": "4"}
    )
    assert (trainer.role, trainer.rank, trainer.num_trainers, trainer.num_ps) == (
        "trainer",
        2,
        3,
        2,
    )
    assert trainer.ps_addr == ("127.0.0.1", 4000) and trainer.ddp_port == 4001
    server = JobEnv.from_environ({**common, "DISTOPT_ROLE": "ps", "REPLICA_ID": "1", "RANK": "1"})
    assert (server.role, server.rank) == ("ps", 1)


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"DISTOPT_ROLE": "worker"}, "DISTOPT_ROLE: expected 'trainer' or 'ps', got 'worker'"),
        ({"RANK": "x"}, "RANK: expected an integer, got 'x'"),
        ({"RANK": "2", "WORLD_SIZE": "2"}, "trainer index 2 is outside 0..1"),
        ({"DISTOPT_ROLE": "ps"}, "DISTOPT_NUM_PS"),
        ({"DISTOPT_NUM_PS": "1", "REPLICA_ID": "0"}, "DISTOPT_NUM_TRAINERS: required"),
        ({"DISTOPT_NUM_PS": "1", "DISTOPT_NUM_TRAINERS": "1", "DISTOPT_PS_ADDR": "h:1"}, "REPLICA_ID"),
        ({"DISTOPT_NUM_PS": "1", "DISTOPT_NUM_TRAINERS": "1", "REPLICA_ID": "0"}, "DISTOPT_PS_ADDR"),
        ({"DISTOPT_NUM_PS": "1", "DISTOPT_NUM_TRAINERS": "1", "REPLICA_ID": "0",
          "DISTOPT_PS_ADDR": "nohost"}, "DISTOPT_PS_ADDR: expected host:port, got 'nohost'"),
    ],
)  # fmt: skip
def test_bad_environment_is_a_one_line_error(env: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError, match="environment") as info:
        JobEnv.from_environ(env)
    assert message in str(info.value) and "\n" not in str(info.value)
