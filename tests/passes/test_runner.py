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
    with pytest.raises(PassError, match=r"pass 'broken' failed: RuntimeError: kaboom \(passes run before it: first\)") as err:
        run_passes(gm, pipeline)
    assert err.value.pass_name == "broken" and err.value.passes_before == ("first",)


def test_timing_and_node_counts_are_recorded() -> None:
    gm = torch.fx.symbolic_trace(M())
    record = run_passes(gm, [PassSpec("insert", _insert_effect)])
    rec = record.passes[0]
    assert rec.seconds >= 0 and rec.nodes_after == len(gm.graph.nodes)
