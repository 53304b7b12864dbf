"""Property tests: random models with remote reads and writes keep their meaning after scheduling.

Each model is a random DAG of dense ops, in-place updates, fetches and pushes over three tables
of the in-process server (two tables share a server, so batching happens). Its forward starts
with ``restart()`` — a write with no resource, conflicting with every call — so every run starts
from the same tables and ``distopt.optimize(..., verify=True, strict=True)`` can compare runs.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import distopt
from distopt.capture.tracer import DistoptTracer
from distopt.passes import run_passes
from distopt.passes.core.pass_base import resolve_pipeline
from distopt.remote.ops import remote_ops
from distopt.remote.wait import is_wait
from tests.passes.remote import inprocess_server as ps
from tests.passes.remote.inprocess_server import STORE, fetch, push, restart

PASSES = ["split_remote", "hoist_issue", "batch_fetch", "sink_wait"]
BATCH, TABLES = 3, ("t0", "t1", "t2")


class RandomModel(nn.Module):
    def __init__(self, steps: list[tuple[Any, ...]]) -> None:
        super().__init__()
        self.steps = steps
        self.layers = nn.ModuleDict(
            {str(i): nn.Linear(ps.DIM, ps.DIM) for i, s in enumerate(steps) if s[0] == "linear"}
        )

    def forward(self, x: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, ...]:
        restart()
        values = [x]
        for i, step in enumerate(self.steps):
            kind = step[0]
            if kind == "linear":
                values.append(self.layers[str(i)](values[step[1]]))
            elif kind == "tanh":
                values.append(torch.tanh(values[step[1]]))
            elif kind == "add":
                values.append(values[step[1]] + values[step[2]])
            elif kind == "inplace":
                buf = values[step[1]].detach().clone()
                buf.mul_(0.5)
                values.append(buf)
            elif kind == "fetch":
                values.append(fetch(step[1], self._ids(ids, values, step[2])))
            elif kind == "push":
                push(step[1], self._ids(ids, values, step[2]), values[step[3]])
        return tuple(values)

    @staticmethod
    def _ids(
        ids: torch.Tensor, values: list[torch.Tensor], source: tuple[str, int]
    ) -> torch.Tensor:
        where, index = source
        if where == "input":
            return ids[:, index]
        # ids computed from a value: the fetch depends on earlier (maybe remote) results.
        return (values[index][:, 0].detach().abs() * 7).long()


@st.composite
def programs(draw: st.DrawFn) -> list[tuple[Any, ...]]:
    steps: list[tuple[Any, ...]] = []
    count = 1  # values available: x
    for _ in range(draw(st.integers(2, 12))):
        value = st.integers(0, count - 1)
        ids = st.one_of(
            st.tuples(st.just("input"), st.integers(0, 2)),
            st.tuples(st.just("value"), value),
        )
        table = st.sampled_from(TABLES)
        kind = draw(
            st.sampled_from(["linear", "tanh", "add", "inplace", "fetch", "fetch", "push", "push"])
        )
        if kind in ("linear", "tanh", "inplace"):
            steps.append((kind, draw(value)))
        elif kind == "add":
            steps.append((kind, draw(value), draw(value)))
        elif kind == "fetch":
            steps.append((kind, draw(table), draw(ids)))
        else:
            steps.append((kind, draw(table), draw(ids), draw(value)))
        count += kind != "push"
    return steps


def _server_trace(log: list[tuple[str, str, int]]) -> dict[str, Any]:
    """Per table: the writes in order, and which version each read saw (reads may reorder)."""
    per_table: dict[str, Any] = {}
    for table in TABLES:
        entries = [(kind, version) for kind, t, version in log if t == table]
        per_table[table] = (
            [v for k, v in entries if k == "write"],
            Counter(v for k, v in entries if k == "read"),
        )
    return per_table


def _run(module: nn.Module, inputs: tuple[torch.Tensor, ...], delay_s: float) -> tuple[Any, ...]:
    STORE.reset(delay_s=delay_s)
    outputs = [t.detach() for t in module(*inputs)]
    assert not STORE.overlaps, STORE.overlaps
    return outputs, STORE.snapshot(), _server_trace(STORE.log)


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(steps=programs(), seed=st.integers(0, 2**16))
def test_scheduled_models_compute_and_write_the_same(
    steps: list[tuple[Any, ...]], seed: int
) -> None:
    torch.manual_seed(seed)
    model = RandomModel(steps)
    inputs = (torch.randn(BATCH, ps.DIM), torch.randint(0, ps.ROWS, (BATCH, 3)))
    STORE.reset()
    gm = distopt.optimize(model, inputs, passes=PASSES, verify=True, strict=True)

    # Every wait waits on an issue placed before it; the pipeline is a fixed point.
    ops = remote_ops(gm.graph)
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    for node in gm.graph.nodes:
        if is_wait(node):
            assert ops[node].kind in ("issue", "batch") and order[ops[node].start] < order[node]
    code = gm.code
    assert not any(p.modified for p in run_passes(gm, resolve_pipeline(PASSES)).passes)
    assert gm.code == code

    # Same outputs, same server state, and each table saw the same sequence of effects —
    # with requests really running concurrently (1 ms per request) in the optimized model.
    ref_out, ref_state, ref_trace = _run(model, inputs, 0.0)
    opt_out, opt_state, opt_trace = _run(gm, inputs, 0.001)
    for got, want in zip(opt_out, ref_out, strict=True):
        torch.testing.assert_close(got, want)
    for table in TABLES:
        torch.testing.assert_close(opt_state[table], ref_state[table])
    assert opt_trace == ref_trace

    # Re-tracing the optimized module gives a graph the passes no longer change.
    STORE.reset()
    again = torch.fx.GraphModule(gm, DistoptTracer().trace(gm))
    assert STORE.requests == 0
    assert not any(p.modified for p in run_passes(again, resolve_pipeline(PASSES)).passes)
