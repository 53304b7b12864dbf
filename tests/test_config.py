import dataclasses
from pathlib import Path
from typing import Literal

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from distopt.config import (
    OptimizeConfig,
    apply_override,
    check,
    find_config_file,
    from_dict,
    load_config,
    load_yaml,
    to_dict,
)
from distopt.errors import ConfigError


@dataclasses.dataclass(kw_only=True, slots=True)
class Inner:
    rate: float = 1.0
    mode: Literal["a", "b"] = "a"

    def __post_init__(self) -> None:
        check(self.rate > 0, "inner.rate", "a number > 0", self.rate)


@dataclasses.dataclass(kw_only=True, slots=True)
class Outer:
    name: str
    steps: int = 3
    tags: tuple[str, ...] = ()
    inner: Inner = dataclasses.field(default_factory=Inner)
    limit: int | None = None


def test_round_trip_through_yaml(tmp_path) -> None:
    path = tmp_path / "job.yaml"
    path.write_text("name: x\nsteps: 5\ntags: [a, b]\ninner: {rate: 0.5, mode: b}\n")
    cfg = load_config(Outer, path)
    assert cfg == Outer(name="x", steps=5, tags=("a", "b"), inner=Inner(rate=0.5, mode="b"))
    assert from_dict(Outer, to_dict(cfg)) == cfg


def test_overrides_are_parsed_as_yaml(tmp_path) -> None:
    path = tmp_path / "job.yaml"
    path.write_text("name: x\n")
    cfg = load_config(Outer, path, ["steps=7", "inner.mode=b", "limit=null"])
    assert (cfg.steps, cfg.inner.mode, cfg.limit) == (7, "b", None)


@pytest.mark.parametrize(
    "data,message",
    [
        (
            {"name": "x", "stpes": 1},
            "stpes: unknown key (known keys: inner, limit, name, steps, tags)",
        ),
        ({"name": "x", "steps": "3"}, "steps: expected an integer, got '3'"),
        ({"name": "x", "steps": True}, "steps: expected an integer, got True"),
        ({"name": "x", "inner": {"rate": 0}}, "inner.rate: expected a number > 0, got 0"),
        ({"name": "x", "inner": {"mode": "c"}}, "inner.mode: expected one of 'a', 'b', got 'c'"),
        ({"name": "x", "inner": {"speed": 1}}, "inner.speed: unknown key"),
        ({"name": "x", "tags": "a"}, "tags: expected a list, got 'a'"),
        ({"steps": 1}, "name: missing (a required key of Outer)"),
    ],
)
def test_errors_name_the_key_and_value(data, message) -> None:
    with pytest.raises(ConfigError) as err:
        from_dict(Outer, data)
    assert message in str(err.value)
    assert "\n" not in str(err.value)


def test_missing_file_and_bad_yaml(tmp_path) -> None:
    with pytest.raises(ConfigError, match="config file not found: .*nope.yaml"):
        load_yaml(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("a: [1, 2\n")
    with pytest.raises(ConfigError, match=r"bad.yaml:\d+"):
        load_yaml(bad)
    listy = tmp_path / "list.yaml"
    listy.write_text("- 1\n")
    with pytest.raises(ConfigError, match="expected a mapping at the top level"):
        load_yaml(listy)


def test_override_needs_key_value() -> None:
    with pytest.raises(ConfigError, match="expected key=value"):
        apply_override({}, "steps")


def test_override_value_that_is_not_yaml_names_the_key() -> None:
    with pytest.raises(ConfigError) as err:
        apply_override({}, "inner.sizes=[8,4")
    assert str(err.value) == (
        "inner.sizes: cannot parse '[8,4' as YAML (expected ',' or ']', but got '<stream end>')"
    )


def test_find_config_file_prefers_the_working_directory(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    shipped = find_config_file("configs/jobs/ps_dlrm.yaml")  # the checkout's, or the package's
    assert shipped.is_absolute() and shipped.parts[-3:] == ("configs", "jobs", "ps_dlrm.yaml")
    assert load_yaml(shipped)["model"] == "dlrm"
    (tmp_path / "configs" / "jobs").mkdir(parents=True)
    (tmp_path / "configs" / "jobs" / "ps_dlrm.yaml").write_text("model: mine\n")
    assert find_config_file("configs/jobs/ps_dlrm.yaml") == Path("configs/jobs/ps_dlrm.yaml")
    assert find_config_file("configs/jobs/nope.yaml") == Path("configs/jobs/nope.yaml")
    assert find_config_file("elsewhere/ps_dlrm.yaml") == Path("elsewhere/ps_dlrm.yaml")


scalars = st.one_of(
    st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False), st.text(max_size=5)
)
values = st.recursive(
    scalars,
    lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=5), c, max_size=3),
    max_leaves=6,
)


@settings(max_examples=200, deadline=None)
@given(
    st.dictionaries(
        st.sampled_from(["capture", "verify", "passes", "pass_options", "dump_graph", "junk"]),
        values,
        max_size=4,
    )
)
def test_fuzzed_optimize_configs_never_escape_as_tracebacks(data) -> None:
    """Any mapping either builds a valid OptimizeConfig or raises a one-line ConfigError."""
    try:
        cfg = from_dict(OptimizeConfig, data)
    except ConfigError as err:
        assert "\n" not in str(err)
    else:
        assert isinstance(cfg, OptimizeConfig)
