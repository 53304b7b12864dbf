"""profile_nodes: medians per node, the user's RNG stream and buffers untouched, remote calls
run once for real (replayed after) or, with a modeled latency, never."""

from __future__ import annotations

import pytest
import torch
import torch.fx

import distopt
from distopt.capture import symbolic_capture
from distopt.config import CaptureConfig
from distopt.estimate.profile import profile_nodes
from distopt.passes.remote.nodes import remote_ops
from tests.estimate.remote_models import Stateful, graphs, inputs, local_nodes
from tests.passes.remote.inprocess_server import STORE


def test_every_local_node_is_timed_and_remote_calls_run_once_per_profile() -> None:
    _, before, _, example = graphs()
    STORE.reset()
    costs = profile_nodes(before, example, repeats=3)
    assert set(costs) == local_nodes(before)
    assert all(c > 0 for c in costs.values())
    assert STORE.requests == 2  # the two fetches, once: the timed repetitions replay them
    profile_nodes(before, example, repeats=3)
    assert STORE.requests == 4  # a new profile is a new step


def test_the_optimized_graph_sends_its_issues_once_too() -> None:
    _, _, after, example = graphs()
    STORE.reset()
    profile_nodes(after, example, repeats=4)
    assert STORE.requests == 2 and STORE.overlaps == []


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
