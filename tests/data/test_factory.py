"""User data factories (distopt.data.factory)."""

from __future__ import annotations

import sys

import pytest
import torch
from torch.utils.data import TensorDataset

from distopt.data.factory import call_factory, load_factory
from distopt.errors import ConfigError


def make_plain(size: int = 4) -> TensorDataset:
    return TensorDataset(torch.arange(size))


def collate_sum(samples):
    return torch.stack([s[0] for s in samples]).sum()


def make_with_collate(size: int = 4):
    return TensorDataset(torch.arange(size)), collate_sum


def make_split(split: str, seed: int):
    return None if split == "eval" else TensorDataset(torch.full((3,), seed))


def make_wrong():
    return [1, 2, 3]


HERE = __name__


def test_plain_tuple_and_split_factories() -> None:
    dataset, collate = call_factory(f"{HERE}:make_plain", {"size": 6}, split="train", seed=0)
    assert len(dataset) == 6 and collate is None
    dataset, collate = call_factory(f"{HERE}:make_with_collate", {}, split="train", seed=0)
    assert collate is collate_sum
    dataset, _ = call_factory(f"{HERE}:make_split", {}, split="train", seed=7)
    assert dataset[0][0].item() == 7
    assert call_factory(f"{HERE}:make_split", {}, split="eval", seed=7) is None


@pytest.mark.parametrize(
    ("spec", "kwargs", "message"),
    [
        (
            "no_such_pkg.mod:make",
            {},
            r"^data.source: cannot import 'no_such_pkg.mod:make' \(ModuleNotFoundError: ",
        ),
        (f"{HERE}:missing", {}, r"^data.source: cannot import '.*:missing' \(AttributeError: "),
        (f"{HERE}:HERE", {}, r"^data.source: '.*:HERE' is a str, not a function$"),
        ("nocolon", {}, r"^data.source: expected 'package.module:function', got 'nocolon'$"),
        (
            f"{HERE}:make_plain",
            {"bogus": 1},
            r"^data.kwargs: got an unexpected keyword argument 'bogus' for",
        ),
        (f"{HERE}:make_wrong", {}, r"^data.source: '.*:make_wrong' returned list, not a Dataset"),
    ],
)
def test_bad_factories_are_one_line_errors_naming_them(
    spec: str, kwargs: dict, message: str
) -> None:
    with pytest.raises(ConfigError, match=message) as info:
        if kwargs or spec.endswith("make_wrong"):
            call_factory(spec, kwargs, split="train", seed=0)
        else:
            load_factory(spec)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(
    ("source", "message"),
    [
        ("def make(split, seed)\n    pass\n", r"SyntaxError: expected ':' \(at .*broken_data\.py:1: def make\(split, seed\)\)$"),
        ("import os\nBUCKET = os.environ['DISTOPT_TEST_UNSET_BUCKET']\n", r"KeyError: 'DISTOPT_TEST_UNSET_BUCKET' \(at .*broken_data\.py:2: "),
    ],
)  # fmt: skip
def test_a_data_module_that_raises_while_importing_is_a_one_line_error(
    tmp_path, monkeypatch: pytest.MonkeyPatch, source: str, message: str
) -> None:
    """A user's data module with a syntax error, or one reading an unset variable at import, had
    escaped the config check as a 45-line traceback (the model's factory gave one line)."""
    (tmp_path / "broken_data.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "broken_data", raising=False)
    with pytest.raises(
        ConfigError,
        match=r"^data.source: importing 'broken_data' for 'broken_data:make' failed: " + message,
    ) as info:
        load_factory("broken_data:make")
    assert "\n" not in str(info.value)
