"""Validation of table specs and server options."""

from __future__ import annotations

import pytest

from distopt.config import from_dict
from distopt.errors import ConfigError
from distopt.ps.spec import ServerOptions, TableSpec, check_tables


def test_placement_defaults() -> None:
    assert TableSpec(name="e", num_rows=4, dim=2).placement(3) == (0, 1, 2)
    dense = TableSpec(name="w", num_rows=4, dim=2, kind="dense").placement(3)
    assert len(dense) == 1 and dense == TableSpec(
        name="w", num_rows=4, dim=2, kind="dense"
    ).placement(3)
    assert TableSpec(name="e", num_rows=4, dim=2, servers=(1,)).placement(2) == (1,)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"num_rows": 0}, r"tables.t.num_rows: expected an integer >= 1, got 0"),
        ({"dim": -2}, r"tables.t.dim: expected an integer >= 1, got -2"),
        (
            {"optimizer": "adam"},
            r"tables.t.optimizer: expected one of 'sgd', 'adagrad', 'rowwise_adagrad', got 'adam'",
        ),
        ({"servers": (0, 0)}, r"tables.t.servers: expected distinct server indices, got \(0, 0\)"),
        ({"kind": "dense", "servers": (0, 1)}, r"one server for a dense table"),
    ],
)
def test_bad_table_spec_names_the_key(kwargs: dict, message: str) -> None:
    base = {"name": "t", "num_rows": 4, "dim": 2}
    with pytest.raises(ConfigError, match=message):
        TableSpec(**{**base, **kwargs})


def test_tables_checked_against_the_job() -> None:
    with pytest.raises(ConfigError, match="unique table names"):
        check_tables([TableSpec(name="a", num_rows=1, dim=1)] * 2, 1)
    with pytest.raises(ConfigError, match="tables.a.servers: expected indices below num_servers=2"):
        check_tables([TableSpec(name="a", num_rows=1, dim=1, servers=(2,))], 2)


def test_server_options_from_yaml_dict() -> None:
    opts = from_dict(ServerOptions, {"num_servers": 2, "latency_ms": 5})
    assert opts.num_servers == 2 and opts.latency_ms == 5.0 and opts.host == "127.0.0.1"
    with pytest.raises(ConfigError, match="ps.latency_ms: expected a number >= 0, got -1"):
        ServerOptions(latency_ms=-1)


def test_transports_are_checked() -> None:
    assert ServerOptions().transports == ("uv",)
    assert from_dict(ServerOptions, {"transports": ["shm", "uv"]}).transports == ("shm", "uv")
    with pytest.raises(
        ConfigError, match=r"ps.transports: expected a non-empty list of 'uv', 'shm', 'ibv'"
    ):
        ServerOptions(transports=("tcp",))


def test_channels_and_command_prefix_are_checked() -> None:
    assert ServerOptions().channels is None and ServerOptions().command_prefix == ()
    opts = from_dict(
        ServerOptions, {"channels": ["basic"], "command_prefix": ["taskset", "-c", "1"]}
    )
    assert opts.channels == ("basic",) and opts.command_prefix == ("taskset", "-c", "1")
    with pytest.raises(ConfigError) as err:
        from_dict(ServerOptions, {"channels": ["tcp"]}, prefix="ps")
    assert str(err.value) == (
        "ps.channels: expected null or a non-empty list of 'basic', 'cma', 'mpt_uv', 'cuda_basic', "
        "'cuda_ipc', 'cuda_gdr', 'cuda_xth', got ('tcp',)"
    )
    with pytest.raises(ConfigError) as err:
        from_dict(ServerOptions, {"backend": "ray", "command_prefix": ["nice"]}, prefix="ps")
    assert str(err.value) == (
        "ps.command_prefix: expected no prefix with ps.backend ray (Ray starts its actors "
        "itself), got ('nice',)"
    )


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("ray_num_cpus", 0, "ps.ray_num_cpus: expected a number > 0, got 0.0"),
        ("ray_memory_mb", -1, "ps.ray_memory_mb: expected an integer >= 0, got -1"),
        ("ray_placement", "TIGHT", "ps.ray_placement: expected one of 'PACK', 'SPREAD', 'STRICT_PACK', "
                                   "'STRICT_SPREAD', got 'TIGHT'"),
        ("ray_address", "head", "ps.ray_address: expected HOST:PORT, ray://HOST:PORT, 'auto' or 'local', "
                                "got 'head'"),
        ("ray_address", "10.0.0.1:99999", "ps.ray_address: expected HOST:PORT, ray://HOST:PORT, 'auto' or "
                                          "'local', got '10.0.0.1:99999'"),
    ],
)  # fmt: skip
def test_ray_actor_options_are_checked(key: str, value: object, message: str) -> None:
    with pytest.raises(ConfigError) as err:
        from_dict(ServerOptions, {key: value}, prefix="ps")
    assert str(err.value) == message


def test_ray_actor_options_from_yaml_dict() -> None:
    opts = from_dict(ServerOptions, {"backend": "ray", "ray_num_cpus": 0.5, "ray_memory_mb": 256,
                                     "ray_placement": "SPREAD", "ray_address": "ray://10.0.0.1:10001"})  # fmt: skip
    assert (opts.ray_num_cpus, opts.ray_memory_mb, opts.ray_placement) == (0.5, 256, "SPREAD")
    assert ServerOptions().ray_num_cpus == 1.0 and ServerOptions().ray_placement == "PACK"
