"""The data: section (distopt.data.config)."""

from __future__ import annotations

import pytest

from distopt.config import from_dict
from distopt.data.config import DataConfig
from distopt.errors import ConfigError


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (
            {"source": "parquet"},
            r"^data.source: expected synthetic, criteo, tokens or package.module:function, got 'parquet'$",
        ),
        ({"source": "nowhere.mod:make"}, r"^data.source: cannot import 'nowhere.mod:make'"),
        ({"source": "criteo"}, r"^data.path: expected a file for source 'criteo', got None$"),
        (
            {"source": "tokens", "path": "t.bin", "holdout_fraction": 1.0},
            r"^data.holdout_fraction: expected a number in \[0, 1\)",
        ),
        (
            {"source": "tokens", "path": "t.bin", "holdout_fraction": 0.1, "eval_path": "e.bin"},
            r"^data.eval_path: expected no eval_path when holdout_fraction is set",
        ),
        ({"holdout_fraction": 0.1}, r"^data.holdout_fraction: expected 0 for synthetic data"),
        (
            {"source": "criteo", "path": "x", "task": "click"},
            r"^data.task: expected no task for a built-in source",
        ),
        (
            {"source": "tokens", "path": "t.bin", "cache_dir": "c"},
            r"^data.cache_dir: expected a directory, for source criteo, got 'c'$",
        ),
        (
            {"token_dtype": "int8"},
            r"^data.token_dtype: expected one of 'uint16', 'uint32', got 'int8'$",
        ),
        ({"num_workers": -1}, r"^data.num_workers: expected an integer >= 0, got -1$"),
        ({"batch": 3}, r"^data.batch: unknown key"),
    ],
)
def test_bad_data_config(data: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message) as info:
        from_dict(DataConfig, data, prefix="data")
    assert "\n" not in str(info.value)


def test_tasks() -> None:
    assert DataConfig().resolved_task == "none"
    assert DataConfig(source="criteo", path="x").resolved_task == "click"
    assert DataConfig(source="tokens", path="x").resolved_task == "tokens"
    factory = "tests.data.test_factory:make_plain"
    assert DataConfig(source=factory).resolved_task == "none"
    assert DataConfig(source=factory, task="click").resolved_task == "click"
