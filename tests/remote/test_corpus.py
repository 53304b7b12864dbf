"""The remote-call passes on parameter-server models written in other people's styles.

Every idiom of :mod:`tests.remote.corpus` against real RPC servers (two worker processes on
127.0.0.1): the expected rewrite (issues before the local tower, waits after it), verification
that replays the servers' answers, no crash with or without example inputs, and equal losses over
8 training steps under ``dist_autograd`` with a ``DistributedOptimizer``.
"""

from __future__ import annotations

import importlib
import warnings

import pytest
import torch
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc
import torch.fx
from torch.distributed.optim import DistributedOptimizer

import distopt
from distopt.remote.local import named_local_tensors
from distopt.remote.ops import remote_ops
from distopt.report import report_of
from tests.remote.corpus import common, tables
from tests.remote.corpus.group import rpc_group
from tests.remote.schedule import schedule

pytestmark = pytest.mark.slow

# What the servers run by name only reads: declared once, as a user would (not in the models).
distopt.register_read(tables.lookup_rows)

OVERLAPPING = [
    "rref_helper",
    "rref_proxy",
    "remote_module",
    "remote_to_here",
    "by_name",
    "user_async",
]
IDIOMS = [*OVERLAPPING, "chained", "reads_writes", "recommender"]


@pytest.fixture(scope="module")
def group():
    with rpc_group(2) as servers:
        yield servers


def _idiom(name: str):
    return importlib.import_module(f"tests.remote.corpus.{name}")


def _optimize(model, inputs=None, **config):
    with warnings.catch_warnings():
        warnings.simplefilter("error", distopt.DistoptFallbackWarning)
        return distopt.optimize(model, inputs, config=config or None)


@pytest.mark.parametrize("name", OVERLAPPING)
def test_reads_are_issued_before_the_tower_and_waited_after_it(group, name: str) -> None:
    idiom = _idiom(name)
    model, inputs = idiom.build(seed=1), common.inputs()
    gm = _optimize(model, inputs)
    report = report_of(gm)
    assert isinstance(gm, torch.fx.GraphModule) and report.tier == "symbolic_trace", report.fallback
    assert report.verification.passed and report.verification.skipped is None
    issues, waits, tower = schedule(gm)
    assert len(issues) == 2 and len(waits) == 2, gm.code
    assert max(issues) < min(tower) and min(waits) > max(tower), gm.code
    torch.testing.assert_close(gm(*inputs), model(*inputs), rtol=0, atol=0)


def test_a_chained_lookup_waits_for_the_one_it_depends_on(group) -> None:
    model, inputs = _idiom("chained").build(seed=2), common.inputs()
    gm = _optimize(model, inputs)
    issues, waits, tower = schedule(gm)
    assert len(issues) == 2 and issues[0] < min(tower)  # the first read overlaps the tower
    assert waits[0] < issues[1]  # the second read needs the first's rows
    torch.testing.assert_close(gm(*inputs), model(*inputs), rtol=0, atol=0)


def test_six_tables_one_chained_all_other_reads_overlap_the_towers(group) -> None:
    model, inputs = _idiom("recommender").build(seed=8), common.inputs()
    gm = _optimize(model, inputs)
    issues, waits, towers = schedule(gm)
    assert len(issues) == 6 and len(waits) == 6
    # Five independent reads go out before any tower; the chained one after the first's rows.
    assert sum(i < min(towers) for i in issues) == 5
    torch.testing.assert_close(gm(*inputs), model(*inputs), rtol=0, atol=0)


def test_a_write_between_reads_is_applied_once_and_in_order(group) -> None:
    model, inputs = _idiom("reads_writes").build(seed=3), common.inputs()
    count = lambda: rpc.rpc_sync("ps0", tables.counter, args=("t0",))  # noqa: E731
    gm = _optimize(model, inputs)
    skipped = report_of(gm).verification.skipped
    assert skipped is not None and "bump_counter" in skipped and count() == 0
    gm = _optimize(model, inputs, verify={"remote_writes": True})
    assert report_of(gm).verification.passed and count() == 32  # the original's run only
    torch.testing.assert_close(gm(*inputs), model(*inputs), rtol=0, atol=0)
    assert count() == 96
    ops = remote_ops(gm.graph)
    writes = [n for n, op in ops.items() if n is op.start and op.is_write]
    reads = [n for n, op in ops.items() if n is op.start and not op.is_write]
    assert len(writes) == 1 and len(reads) == 2


@pytest.mark.parametrize("name", IDIOMS)
def test_without_example_inputs_the_result_runs_and_computes_the_same(group, name: str) -> None:
    model, inputs = _idiom(name).build(seed=4), common.inputs(seed=5)
    gm = _optimize(model)
    assert isinstance(gm, torch.fx.GraphModule)
    torch.testing.assert_close(gm(*inputs), model(*inputs), rtol=0, atol=0)


def test_randomness_on_the_server_does_not_fail_verification(group) -> None:
    from tests.remote.corpus.rref_helper import Model

    model = common.seeded(0, Model(seed=6, table_cls=tables.DropoutTable))
    gm = _optimize(model, common.inputs())
    verification = report_of(gm).verification
    assert verification.passed and verification.compared > 0


def _train(model, remote_params: list, steps: int = 8) -> list[float]:
    local = [rpc.RRef(p) for _, p in named_local_tensors(model, "_parameters")]
    # 0.1: with the 5 ms tower (corpus.common), 0.05 moved the loss less than batch-to-batch noise
    optimizer = DistributedOptimizer(torch.optim.SGD, local + remote_params, lr=0.1)
    losses = []
    for step in range(steps):
        dense, ids = common.inputs(seed=100 + step)
        with dist_autograd.context() as context:
            loss = common.loss(model(dense, ids), common.targets(seed=100 + step))
            dist_autograd.backward(context, [loss])
            optimizer.step(context)
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("name", IDIOMS)
def test_training_under_dist_autograd_gives_equal_losses(group, name: str) -> None:
    idiom = _idiom(name)
    original = idiom.build(seed=7)
    expected = _train(original, idiom.remote_parameters(original))
    twin = idiom.build(seed=7)  # same local and remote initial values
    optimized = _optimize(twin, common.inputs(), verify={"remote_writes": True})
    assert isinstance(optimized, torch.fx.GraphModule)
    got = _train(optimized, idiom.remote_parameters(twin))
    assert got == pytest.approx(expected, rel=1e-6, abs=1e-7)
    assert expected[-1] < expected[0]  # it trains (the tables too, where they are modules)
