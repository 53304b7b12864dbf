import pytest
import torch.fx

from distopt.errors import ConfigError
from distopt.passes import PassResult, register_pass, resolve_pipeline, unregister_pass


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
