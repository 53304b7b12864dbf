import random

import pytest
import torch.fx

from distopt.errors import ConfigError
from distopt.passes import (
    BUILTIN_PASSES,
    PassResult,
    add_passes,
    register_pass,
    registered_passes,
    resolve_pipeline,
    unregister_pass,
)
from distopt.passes.core import pass_base


def _noop(gm: torch.fx.GraphModule, ctx) -> PassResult:
    return PassResult(modified=False)


@pytest.fixture
def three_passes():
    names = ["t_late", "t_early", "t_middle"]
    register_pass("t_late", after=("t_middle",), default=False)(_noop)
    register_pass("t_early", before=("t_middle",), default=False)(_noop)
    register_pass("t_middle", default=False)(_noop)
    yield names
    for name in names:
        unregister_pass(name)


def test_constraints_decide_order_not_list_order(three_passes) -> None:
    order = [spec.name for spec in resolve_pipeline(["t_late", "t_middle", "t_early"])]
    assert order == ["t_early", "t_middle", "t_late"]


def test_constraints_on_unselected_passes_are_ignored(three_passes) -> None:
    assert [s.name for s in resolve_pipeline(["t_late", "t_early"])] == ["t_late", "t_early"]


def test_unknown_pass_name_is_a_one_line_error() -> None:
    with pytest.raises(ConfigError, match="unknown pass 'nope'") as err:
        resolve_pipeline(["nope"])
    assert "\n" not in str(err.value)


def test_duplicate_and_cycle_are_rejected(three_passes) -> None:
    with pytest.raises(ConfigError, match="listed twice"):
        resolve_pipeline(["t_late", "t_late"])
    register_pass("t_cycle", after=("t_late",), before=("t_early",), default=False)(_noop)
    try:
        with pytest.raises(ConfigError, match="cycle"):
            resolve_pipeline(["t_early", "t_middle", "t_late", "t_cycle"])
    finally:
        unregister_pass("t_cycle")


def test_default_pipeline_contains_only_default_passes() -> None:
    assert all(spec.default for spec in resolve_pipeline(None))


DEFAULT_PIPELINE = [
    "remove_identity",
    "fold_conv_bn",
    "mkldnn_fusion",
    "channels_last",
    "pair_user_waits",
    "split_remote",
    "hoist_issue",
    "batch_fetch",
    "sink_wait",
]


def test_the_default_pipeline_does_not_depend_on_the_order_the_builtins_are_listed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    listed = sorted(BUILTIN_PASSES, key=lambda spec: spec.name)
    for order in (listed, listed[::-1], random.Random(0).sample(listed, len(listed))):
        monkeypatch.setattr(pass_base, "_REGISTRY", {})
        add_passes(order)
        assert [spec.name for spec in resolve_pipeline(None)] == DEFAULT_PIPELINE


def test_every_builtin_pass_module_declares_the_pass_the_package_lists() -> None:
    names = {spec.name for spec in BUILTIN_PASSES}
    assert names == {"channels_last", "fold_conv_bn", "fuse_units", "partition", *DEFAULT_PIPELINE}
    assert {name: registered_passes()[name] for name in names} == {
        s.name: s for s in BUILTIN_PASSES
    }


def test_user_passes_follow_the_builtins_they_do_not_constrain() -> None:
    register_pass("t_default")(_noop)
    try:
        assert [spec.name for spec in resolve_pipeline(None)] == [*DEFAULT_PIPELINE, "t_default"]
    finally:
        unregister_pass("t_default")


def test_a_name_taken_by_another_function_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"^pass 'split_remote' is already registered by"):
        register_pass("split_remote")(_noop)
