"""profile_nodes: medians per node, the user's RNG stream and buffers untouched, remote reads
sent and timed in every run, writes never sent, and with a modeled latency nothing sent."""

from __future__ import annotations

import pytest
import torch
import torch.fx

import distopt
from distopt.capture import symbolic_capture
from distopt.config import CaptureConfig
from distopt.estimate.profile import profile_nodes
from distopt.remote.ops import remote_ops
from tests.estimate.remote_models import Stateful, graphs, inputs, local_nodes
from tests.passes.remote.inprocess_server import STORE, fetch, push


def test_every_local_node_and_every_read_is_timed() -> None:
    _, before, _, example = graphs()
    STORE.reset(delay_s=0.01)
    costs = profile_nodes(before, example, repeats=3)
    fetches = {n.name for n in before.graph.nodes if n.target is fetch}
    assert set(costs) == local_nodes(before) | fetches
    assert all(c > 0 for c in costs.values())
    assert all(costs[name] >= 0.01 for name in fetches)  # a read costs its round trip
    assert STORE.requests == 2 * 4  # the two reads in the warm-up and each timed run


def test_the_optimized_graph_times_each_issue_until_its_answer() -> None:
    _, _, after, example = graphs()
    STORE.reset(delay_s=0.01)
    costs = profile_nodes(after, example, repeats=4)
    ops = remote_ops(after.graph)
    starts = {op.start.name for op in ops.values()}
    assert all(costs[n] >= 0.01 for n in starts)
    assert all(costs[n.name] == 0.0 for n in ops if n.name not in starts)  # waits
    assert STORE.requests == 2 * 5 and STORE.overlaps == []


def test_a_remote_write_is_never_sent() -> None:
    class Writes(torch.nn.Module):
        def forward(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
            push("t1", ids, x)
            return x * 2 + fetch("t0", ids)

    gm = symbolic_capture(Writes(), CaptureConfig())
    STORE.reset()
    before = STORE.snapshot()
    costs = profile_nodes(gm, (torch.ones(3, 4), torch.tensor([1, 2, 3])), repeats=2)
    assert torch.equal(STORE.snapshot()["t1"], before["t1"])
    assert STORE.requests == 3  # the read, three times; the write never
    write = next(n for n in gm.graph.nodes if n.target is push)
    assert write.name not in costs and "mul" in costs


def test_the_users_random_stream_is_untouched() -> None:
    gm = symbolic_capture(Stateful(), CaptureConfig())
    example = inputs()
    state = torch.random.get_rng_state()
    gm(*example)
    assert not torch.equal(torch.random.get_rng_state(), state)  # dropout draws numbers
    state = torch.random.get_rng_state()
    profile_nodes(gm, example, repeats=2)
    assert torch.equal(torch.random.get_rng_state(), state)


def test_buffers_and_grads_are_untouched() -> None:
    model = Stateful()
    gm = symbolic_capture(model, CaptureConfig())
    example = inputs()
    grad = torch.ones(4)
    model.norm.weight.grad = grad
    saved = {name: b.clone() for name, b in model.named_buffers()}
    profile_nodes(gm, example, repeats=2, grad=True)
    for name, buffer in model.named_buffers():
        torch.testing.assert_close(buffer, saved[name], msg=name)
    assert model.norm.weight.grad is grad
    gm(*example)
    assert model.norm.num_batches_tracked.item() == 1  # a real run does update them


def test_runs_without_grad_unless_told() -> None:
    seen: list[bool] = []

    def probe(x: torch.Tensor) -> torch.Tensor:
        seen.append(torch.is_grad_enabled())
        return x

    graph = torch.fx.Graph()
    graph.output(graph.call_function(probe, (graph.placeholder("x"),)))
    gm = torch.fx.GraphModule(torch.nn.Module(), graph)
    profile_nodes(gm, (torch.ones(1),), repeats=2)
    profile_nodes(gm, (torch.ones(1),), repeats=2, grad=True)
    assert seen == [False] * 3 + [True] * 3  # warm-up + 2 timed runs each


def test_modeled_latency_never_calls_the_server() -> None:
    _, before, after, example = graphs()
    STORE.reset()
    for gm in (before, after):
        costs = profile_nodes(gm, example, repeats=2, remote_latency_s=0.007)
        ops = remote_ops(gm.graph)
        starts = {op.start.name for op in ops.values()}
        assert {n: costs[n] for n in starts} == dict.fromkeys(starts, 0.007)
        waits = {n.name for n in ops} - starts
        assert all(costs[n] == 0.0 for n in waits)
        # The tower runs; the adds need fetched rows, so they cannot run and have no cost.
        assert {"fc1", "relu", "fc2"} <= set(costs) and "add" not in costs
    assert STORE.requests == 0


def test_a_graph_without_remote_calls_is_profiled_whole_in_modeled_mode() -> None:
    gm = torch.fx.symbolic_trace(torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU()))
    costs = profile_nodes(gm, (torch.randn(1, 2),), remote_latency_s=0.0)
    assert set(costs) == {"_0", "_1"}


def test_bad_arguments_name_the_argument() -> None:
    gm = torch.fx.symbolic_trace(torch.nn.ReLU())
    with pytest.raises(distopt.ConfigError, match="repeats.*0"):
        profile_nodes(gm, (torch.ones(1),), repeats=0)
    with pytest.raises(distopt.ConfigError, match="remote_latency_s.*-1"):
        profile_nodes(gm, (torch.ones(1),), remote_latency_s=-1.0)
