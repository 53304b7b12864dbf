"""The partition and fuse_units passes: balanced contiguous units, names kept, pairs never cut."""

from __future__ import annotations

import pytest
import torch
import torch.fx
from torch import nn

import distopt
from distopt.errors import ConfigError, PassError
from distopt.models import build, make_inputs
from distopt.parallel import materialize_units, plan_of, unit_modules
from distopt.passes import PassContext
from distopt.passes.fsdp.fuse_units import merge_small_units
from distopt.passes.fsdp.partition import (
    PLAN_META,
    UNIT_META,
    PartitionOptions,
    block_key,
    plan_partition,
)


def _gpt(layers: int = 4) -> nn.Module:
    return build("gpt", vocab_size=64, dim=32, heads=2, layers=layers, seq_len=16, dropout=0.0)


def _partitioned(model: nn.Module, **options) -> torch.fx.GraphModule:
    inputs = make_inputs("gpt", model, 2)
    gm = distopt.optimize(
        model,
        inputs,
        passes=["partition"],
        config={"pass_options": {"partition": options}},
        strict=True,
    )
    assert isinstance(gm, torch.fx.GraphModule)
    return gm


def test_units_are_contiguous_and_cover_every_node() -> None:
    gm = _partitioned(_gpt(), num_units=3)
    units = [n.meta[UNIT_META] for n in gm.graph.nodes]
    assert units == sorted(units), "units must be contiguous in graph order"
    assert set(units) == {0, 1, 2}
    plan = plan_of(gm)
    assert plan is not None and len(plan.units) == 3 and plan.cost_source == "profile"


def test_default_cuts_at_block_boundaries_one_unit_per_block() -> None:
    gm = _partitioned(_gpt(layers=4))
    plan = gm.meta[PLAN_META]
    assert len(plan.units) == 6  # four blocks, the embeddings before them, the norm and head after
    # No block is split across units.
    owner: dict[str, int] = {}
    for unit in plan.units:
        for name in unit.state_names:
            key = block_key(name)
            if key.startswith("blocks."):
                assert owner.setdefault(key, unit.index) == unit.index, name


def test_units_balance_parameter_bytes() -> None:
    gm = _partitioned(_gpt(layers=6), num_units=3, compute_weight=0.0)
    sizes = plan_of(gm).unit_bytes
    assert max(sizes) < 1.6 * (sum(sizes) / len(sizes)), sizes


def test_memory_budget_bounds_unit_bytes() -> None:
    model = _gpt(layers=4)
    block_bytes = sum(p.numel() * 4 for p in model.blocks[0].parameters())
    gm = _partitioned(model, max_unit_bytes=2 * block_bytes + 1)
    sizes = plan_of(gm).unit_bytes
    assert all(s <= 2 * block_bytes + 1 for s in sizes), sizes
    assert len(sizes) >= 3


def test_state_dict_keys_unchanged_by_partition_and_materialization() -> None:
    model = _gpt()
    gm = _partitioned(model, num_units=3)
    assert list(gm.state_dict().keys()) == list(model.state_dict().keys())
    split = materialize_units(gm)
    assert list(split.state_dict().keys()) == list(model.state_dict().keys())
    assert len(unit_modules(split)) == 3
    x = make_inputs("gpt", model, 2)
    torch.testing.assert_close(split(*x), model(*x))


def test_state_dict_round_trip_through_units() -> None:
    model = _gpt()
    split = materialize_units(_partitioned(model, num_units=3))
    other = _gpt()  # different random weights
    split.load_state_dict(other.state_dict())
    x = make_inputs("gpt", model, 2)
    torch.testing.assert_close(split(*x), other(*x))
    fresh = _gpt()
    fresh.load_state_dict(split.state_dict())
    torch.testing.assert_close(fresh(*x), other(*x))


def test_untouched_parameters_keep_their_names() -> None:
    class WithSpare(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)
            self.spare = nn.Linear(4, 4)  # never used in forward

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.b(self.a(x))

    model = WithSpare()
    gm = distopt.optimize(
        model,
        torch.randn(2, 4),
        passes=["partition"],
        config={"pass_options": {"partition": {"num_units": 2}}},
    )
    split = materialize_units(gm)
    assert list(split.state_dict().keys()) == list(model.state_dict().keys())


def test_tied_weights_stay_in_one_unit() -> None:
    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Linear(8, 8)
            self.mid = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = self.emb(x)
            for layer in self.mid:
                x = layer(x)
            return self.emb(x)  # the same module again at the end

    gm = distopt.optimize(
        Tied(),
        torch.randn(2, 8),
        passes=["partition"],
        config={"pass_options": {"partition": {"num_units": 4}}},
    )
    assert len(plan_of(gm).units) == 1
    materialize_units(gm)  # no parameter shared between units


def wait_stub(fut):  # stands in for a registered wait
    return fut


def test_never_cuts_between_remote_issue_and_wait() -> None:
    from distopt.remote import register_remote, unregister_remote

    def fetch(x: torch.Tensor) -> torch.Tensor:
        return x

    def fetch_async(x: torch.Tensor):
        fut = torch.futures.Future()
        fut.set_result(x)
        return fut

    register_remote(fetch, issue=fetch_async, effect="read")
    try:
        layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(6))
        graph = torch.fx.Graph()
        x = graph.placeholder("x")
        fut = graph.call_function(fetch_async, (x,))
        h = x
        for i in range(6):
            h = graph.call_module(f"layers.{i}", (h,))
        got = graph.call_function(torch.futures.Future.wait, (fut,))
        graph.output(graph.call_function(torch.add, (h, got)))
        root = nn.Module()
        root.layers = layers
        gm = torch.fx.GraphModule(root, graph)
        plan = plan_partition(gm, PartitionOptions(num_units=3))
        unit = {name: u.index for u in plan.units for name in u.nodes}
        assert unit[fut.name] == unit[got.name]
        # With the span blocked there is no legal cut at all: one unit.
        assert len(plan.units) == 1
    finally:
        unregister_remote(fetch)


def test_nodes_sharing_a_remote_pair_meta_stay_together() -> None:
    model = _gpt(layers=4)
    gm = _partitioned(model, num_units=5)
    nodes = [n for n in gm.graph.nodes if n.op == "call_module"]
    nodes[1].meta["distopt_remote_pair"] = "p0"
    nodes[-2].meta["distopt_remote_pair"] = "p0"
    plan = plan_partition(gm, PartitionOptions(num_units=5))
    unit = {name: u.index for u in plan.units for name in u.nodes}
    assert unit[nodes[1].name] == unit[nodes[-2].name]


def test_bad_options_name_the_key() -> None:
    with pytest.raises(PassError, match="partition.num_units.*0"):
        _partitioned(_gpt(), num_units=0)
    with pytest.raises(ConfigError, match="cost"):
        PartitionOptions(cost="guess")


def test_fuse_merges_units_below_minimum() -> None:
    gm = _partitioned(_gpt(layers=4), num_units=5)
    plan = plan_of(gm)
    smallest = min(plan.unit_bytes)
    fused = merge_small_units(plan, smallest + 1)
    assert len(fused.units) == len(plan.units) - 1
    assert sum(fused.unit_bytes) == sum(plan.unit_bytes)
    assert all(b > smallest for b in fused.unit_bytes)


def test_fuse_units_pass_with_given_minimum() -> None:
    model = _gpt(layers=4)
    gm = distopt.optimize(
        model,
        make_inputs("gpt", model, 2),
        passes=["partition", "fuse_units"],
        config={
            "pass_options": {"partition": {"num_units": 5}, "fuse_units": {"min_unit_bytes": 10**9}}
        },
    )
    assert len(plan_of(gm).units) == 1
    assert {n.meta[UNIT_META] for n in gm.graph.nodes} == {0}


def test_fuse_units_requires_partition() -> None:
    from distopt.passes.fsdp.fuse_units import fuse_units

    gm = torch.fx.symbolic_trace(nn.Linear(2, 2))
    with pytest.raises(ConfigError, match="partition"):
        fuse_units(gm, PassContext(options={"min_unit_bytes": 1}))


def test_profiling_never_talks_to_servers() -> None:
    from tests.passes.remote.inprocess_server import DIM, STORE, fetch, push

    class Remote(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList(nn.Linear(DIM, DIM) for _ in range(4))

        def forward(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
            push("t0", ids, x)  # the result is unused: the rest of the graph can be profiled
            for layer in self.layers:
                x = layer(x)
            return x + fetch("t1", ids) if self.read else x

    inputs = (torch.randn(3, DIM), torch.tensor([1, 2, 3]))
    options = {"pass_options": {"partition": {"num_units": 2}}}
    for read, source in ((False, "profile"), (True, "estimate")):
        model = Remote()
        model.read = read  # with a fetch the final add needs server rows: estimates instead
        STORE.reset()
        gm = distopt.optimize(
            model, inputs, passes=["partition"], config=options, verify=False, strict=True
        )
        assert plan_of(gm).cost_source == source
        assert STORE.requests == 0
