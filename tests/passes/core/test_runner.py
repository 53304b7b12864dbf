import operator

import pytest
import torch
import torch.fx
from torch import nn

from distopt.errors import PassError
from distopt.passes import PassResult, PassSpec, mark_side_effectful, run_passes


class M(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x * 3  # dead: must be removed
        x.add_(0)  # in place: must stay
        return x + 1


def record_effect(x: torch.Tensor) -> None:
    return None


def _insert_effect(gm: torch.fx.GraphModule, ctx) -> PassResult:
    placeholder = next(iter(gm.graph.nodes))
    with gm.graph.inserting_after(placeholder):
        gm.graph.call_function(record_effect, (placeholder,))
    return PassResult(modified=True, detail="inserted")


def _boom(gm: torch.fx.GraphModule, ctx) -> PassResult:
    raise RuntimeError("kaboom")


def test_dce_drops_dead_pure_nodes_but_keeps_side_effects() -> None:
    mark_side_effectful(record_effect)
    gm = torch.fx.symbolic_trace(M())
    record = run_passes(gm, [PassSpec("insert", _insert_effect)])
    targets = [n.target for n in gm.graph.nodes]
    assert operator.mul not in targets
    assert "add_" in targets and record_effect in targets
    assert record.passes[0].modified and record.passes[0].nodes_changed >= 1
    assert record.dce_removed == 1
    assert "record_effect" in record.code_after


def test_failing_pass_is_named_with_passes_before_it() -> None:
    gm = torch.fx.symbolic_trace(M())
    pipeline = [PassSpec("first", _insert_effect), PassSpec("broken", _boom)]
    with pytest.raises(
        PassError,
        match=r"pass 'broken' failed: RuntimeError: kaboom \(passes run before it: first\)",
    ) as err:
        run_passes(gm, pipeline)
    assert err.value.pass_name == "broken" and err.value.passes_before == ("first",)


def test_timing_and_node_counts_are_recorded() -> None:
    gm = torch.fx.symbolic_trace(M())
    record = run_passes(gm, [PassSpec("insert", _insert_effect)])
    rec = record.passes[0]
    assert rec.seconds >= 0 and rec.nodes_after == len(gm.graph.nodes)


class Chain(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(torch.relu(torch.relu(x)))


def _tag_one(gm: torch.fx.GraphModule, ctx) -> PassResult:
    """Tags the first untagged relu: one more each time it runs."""
    for node in gm.graph.nodes:
        if node.target is torch.relu and "tag" not in node.meta:
            node.meta["tag"] = "a"
            return PassResult(modified=True, detail=f"tagged {node.name}")
    return PassResult(modified=False, detail="nothing to tag")


def _follow(gm: torch.fx.GraphModule, ctx) -> PassResult:
    """A pass of the same group that changes nothing."""
    return PassResult(modified=False, detail="saw tags")


def test_a_fixed_point_group_repeats_until_a_round_changes_nothing() -> None:
    gm = torch.fx.symbolic_trace(Chain())
    pipeline = [
        PassSpec("tag", _tag_one, fixed_point="g"),
        PassSpec("follow", _follow, fixed_point="g"),
    ]
    record = run_passes(gm, pipeline)
    # One relu tagged per round: three rounds tag, the fourth finds nothing and ends the loop.
    assert all(n.meta.get("tag") == "a" for n in gm.graph.nodes if n.target is torch.relu)
    names = [p.name for p in record.passes]
    assert names == ["tag", "follow", "tag (round 2)", "tag (round 3)"]


def test_passes_outside_a_group_run_once() -> None:
    gm = torch.fx.symbolic_trace(Chain())
    record = run_passes(gm, [PassSpec("tag", _tag_one), PassSpec("follow", _follow)])
    assert [p.name for p in record.passes] == ["tag", "follow"]
    assert sum("tag" in n.meta for n in gm.graph.nodes) == 1


def test_a_group_that_never_settles_stops_after_the_round_limit() -> None:
    gm = torch.fx.symbolic_trace(Chain())

    def always(gm: torch.fx.GraphModule, ctx) -> PassResult:
        return PassResult(modified=True, detail="claims a change")

    pipeline = [
        PassSpec("always", always, fixed_point="g"),
        PassSpec("follow", _follow, fixed_point="g"),
    ]
    record = run_passes(gm, pipeline)
    assert [p.name for p in record.passes][-1] == "always (round 8)"
