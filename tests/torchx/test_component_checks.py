"""The submit-time checks of the components: TorchX's comma split undone, errors name the flag."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from distopt.errors import ConfigError
from distopt.torchx.component_checks import checked_config, join_set_items


@pytest.mark.parametrize(
    ("pieces", "items"),
    [
        (["a=1", "b=2"], ["a=1", "b=2"]),
        (["a=[8", "4]", "b=5"], ["a=[8,4]", "b=5"]),
        (["a={x: [1", "2]", "y: 3}", "b=[]"], ["a={x: [1,2],y: 3}", "b=[]"]),
        (["a=[8", " 4]"], ["a=[8, 4]"]),
        (["a=[8", "b=5"], ["a=[8,b=5"]),  # never closed: left for the YAML parser to refuse
        (["a=8]", "b=5"], ["a=8]", "b=5"]),
    ],
)
def test_join_set_items(pieces: list[str], items: list[str]) -> None:
    assert join_set_items(pieces) == items


@dataclasses.dataclass(kw_only=True, slots=True)
class Job:
    name: str
    steps: int = 1
    sizes: list[int] = dataclasses.field(default_factory=list)
    output_dir: str = "runs"


@pytest.fixture
def config(tmp_path: Path) -> str:
    path = tmp_path / "job.yaml"
    path.write_text("name: x\n")
    return str(path)


def test_overrides_pass_on_after_the_merged_config_builds(config: str) -> None:
    items, built = checked_config(config, ["sizes=[8", "4]", " steps=2 ", ""], "out", schema=Job)
    assert items == ["sizes=[8,4]", "steps=2", "output_dir=out"]
    assert built == Job(name="x", steps=2, sizes=[8, 4], output_dir="out")


@pytest.mark.parametrize(
    ("items", "message"),
    [
        (["stpes=5"], "--set: stpes: unknown key (known keys: name, output_dir, sizes, steps)"),
        (["steps=abc"], "--set: steps: expected an integer, got 'abc'"),
        (["sizes=[8", "x]"], "--set: sizes[1]: expected an integer, got 'x'"),
        (["sizes=[8"], "--set: sizes: cannot parse '[8' as YAML "
                       "(expected ',' or ']', but got '<stream end>')"),
        (["steps"], "--set: override 'steps': expected key=value"),
        (["steps=2", "name=[1]"], "--set: name: expected a string, got [1]"),
    ],
)  # fmt: skip
def test_errors_name_the_flag_and_the_key(config: str, items: list[str], message: str) -> None:
    with pytest.raises(ConfigError) as err:
        checked_config(config, items, None, schema=Job)
    assert str(err.value) == message


def test_errors_of_the_file_name_the_file(tmp_path: Path) -> None:
    path = tmp_path / "job.yaml"
    path.write_text("steps: 2\n")
    with pytest.raises(ConfigError) as err:
        checked_config(str(path), ["sizes=[1]"], None, schema=Job)
    assert str(err.value) == f"--config: {path}: name: missing (a required key of Job)"
    with pytest.raises(ConfigError) as err:
        checked_config(str(path), None, "/out", schema=Job)
    assert str(err.value).startswith(f"--config: {path}: name: ")


def test_without_a_schema_only_the_syntax_is_checked(config: str) -> None:
    assert checked_config(config, ["anything=1"], None, schema=None) == (["anything=1"], None)
    with pytest.raises(ConfigError, match=r"^--set: anything: cannot parse"):
        checked_config(config, ["anything=[1"], None, schema=None)
    with pytest.raises(ConfigError, match=r"^--config: a config file path is required$"):
        checked_config("", None, None, schema=None)
