"""Cross-step prefetch on corpus models whose tables are written by user RPCs, not distopt.ps.

The pipeline counts staleness only against distopt.ps pushes. Where a user RPC writes what a
prefetched read reads, exact mode must still equal the optimized model bit for bit, and a
staleness the pipeline could not count must be refused before any step, in one line.
"""

from __future__ import annotations

import importlib
import threading
from collections.abc import Iterator

import pytest
import torch
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc

import distopt
from distopt.errors import ConfigError
from distopt.pipeline import TrainPipeline
from distopt.pipeline.checks import in_dist_autograd
from tests.remote.corpus import common, tables
from tests.remote.corpus.group import rpc_group

pytestmark = pytest.mark.slow

distopt.register_read(tables.lookup_rows)
STEPS = 5


@pytest.fixture(scope="module")
def group():
    with rpc_group(2) as servers:
        yield servers


def _optimized(name: str, seed: int = 5, example: bool = True) -> torch.fx.GraphModule:
    model = importlib.import_module(f"tests.remote.corpus.{name}").build(seed=seed)
    inputs = common.inputs() if example else None
    return distopt.optimize(model, inputs, config={"verify": {"remote_writes": True}}, strict=True)


def _batches() -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    return [(*common.inputs(seed=300 + s), common.targets(seed=300 + s)) for s in range(STEPS)]


def _loss(out, batch):
    return common.loss(out, batch[2])


def _decay_t0() -> None:
    """A user's own write between steps: nudge every row of table t0 on ps0."""
    rpc.rpc_sync("ps0", tables.add_rows, args=("t0", torch.arange(tables.NUM_ROWS), 0.01))


def _sequential(gm, push=None) -> list[float]:
    opt = torch.optim.SGD(gm.parameters(), lr=0.05)
    losses = []
    for batch in _batches():
        opt.zero_grad(set_to_none=True)
        loss = _loss(gm(*batch[:2]), batch)
        loss.backward()
        if push is not None:
            push()
        opt.step()
        losses.append(loss.item())
    return losses


def _pipelined(gm, staleness: int, push=None) -> list[float]:
    pipe = TrainPipeline(
        gm,
        torch.optim.SGD(gm.parameters(), lr=0.05),
        iter(_batches()),
        staleness=staleness,
        inputs=lambda b: b[:2],
        loss_fn=_loss,
        push=push,
    )
    losses = [out.loss.item() for out in pipe.run()]
    pipe.close()
    return losses


class Feed(Iterator):
    """The batches, counting how many the pipeline pulled."""

    def __init__(self, batches: list) -> None:
        self.batches = iter(batches)
        self.pulled = 0

    def __next__(self):
        batch = next(self.batches)
        self.pulled += 1
        return batch


def _state(gm) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in gm.state_dict().items()}


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("staleness", [0, 1])
def test_reads_and_a_forward_write_train_exactly_and_write_as_often(group, staleness) -> None:
    # reads_writes bumps a counter of t0 in every forward: the prefetch of the next batch comes
    # after that forward (its write is waited inside it) with staleness 0 and 1 alike.
    gm = _optimized("reads_writes")
    expected, params = _sequential(gm), _state(gm)
    count = rpc.rpc_sync("ps0", tables.counter, args=("t0",))
    gm = _optimized("reads_writes")  # rebuilds t0, t1 and resets the counter
    assert _pipelined(gm, staleness) == expected
    assert _same(_state(gm), params)
    assert rpc.rpc_sync("ps0", tables.counter, args=("t0",)) == count


def test_two_steps_ahead_of_a_forward_write_is_refused(group) -> None:
    with pytest.raises(ConfigError) as caught:
        _pipelined(_optimized("reads_writes"), staleness=2)
    message = str(caught.value)
    assert message.startswith("pipeline: model Model: staleness=2 cannot count what the read ")
    assert (
        "bump_counter" in message and message.endswith("use staleness <= 1") and "\n" not in message
    )


def test_exact_mode_sees_a_user_rpc_push_as_the_optimized_model_does(group) -> None:
    gm = _optimized("by_name")
    expected, params = _sequential(gm, push=_decay_t0), _state(gm)
    rows = rpc.rpc_sync("ps0", tables.table_rows, args=("t0",))
    gm = _optimized("by_name")  # rebuilds t0 as it started
    assert _pipelined(gm, staleness=0, push=_decay_t0) == expected
    assert _same(_state(gm), params)
    assert torch.equal(rpc.rpc_sync("ps0", tables.table_rows, args=("t0",)), rows)


def test_staleness_ahead_of_a_user_rpc_push_is_refused_before_any_step(group) -> None:
    # Run, this would read t0 before the last nudge and report staleness 0 (measured by hand:
    # the losses drifted by up to 3.0 within 5 steps while stats said staleness_max=0).
    gm = _optimized("by_name")
    rows = rpc.rpc_sync("ps0", tables.table_rows, args=("t0",))
    feed = Feed(_batches())
    with pytest.raises(ConfigError) as caught:
        TrainPipeline(
            gm,
            torch.optim.SGD(gm.parameters(), lr=0.05),
            feed,
            staleness=1,
            inputs=lambda b: b[:2],
            loss_fn=_loss,
            push=_decay_t0,
        )
    message = str(caught.value)
    assert message.startswith("pipeline: model Model: staleness=1 cannot count what the read ")
    assert 'e0 = rpc.rpc_sync(self.servers[0], lookup_rows, args=("t0", ids[:, 0]))' in message
    assert message.endswith("use staleness=0 (exact)") and "\n" not in message
    assert feed.pulled == 0
    assert torch.equal(rpc.rpc_sync("ps0", tables.table_rows, args=("t0",)), rows)


def test_the_rpc_tutorials_dist_autograd_loop_is_refused_before_any_step(group) -> None:
    gm = _optimized("rref_helper")
    feed = Feed(_batches())
    pipe = TrainPipeline(
        gm, torch.optim.SGD(gm.parameters(), lr=0.05), feed, inputs=lambda b: b[:2], loss_fn=_loss
    )
    with dist_autograd.context(), pytest.raises(ConfigError) as caught:
        pipe.progress()
    assert str(caught.value).startswith(
        "pipeline: model Model: progress() ran inside a dist_autograd context"
    )
    assert feed.pulled == 0 and pipe.steps == 0
    pipe.close()


def test_only_this_threads_dist_autograd_context_counts(group) -> None:
    """The check answers from the process's context count when it is 0; another thread's
    context (a server handling a dist_autograd RPC, say) must not refuse this thread's steps."""
    assert not in_dist_autograd()
    entered, leave = threading.Event(), threading.Event()

    def hold() -> None:
        with dist_autograd.context():
            entered.set()
            leave.wait(30)

    holder = threading.Thread(target=hold)
    holder.start()
    try:
        assert entered.wait(30)
        assert not in_dist_autograd()
        with dist_autograd.context():
            assert in_dist_autograd()
    finally:
        leave.set()
        holder.join()
    assert not in_dist_autograd()


def test_a_model_that_needs_dynamo_is_refused_naming_its_branch(group) -> None:
    model = importlib.import_module("tests.remote.corpus.hf_bert").build(seed=1)
    compiled = distopt.optimize(model)  # Dynamo compiles lazily: nothing runs here
    with pytest.raises(ConfigError) as caught:
        TrainPipeline(compiled, torch.optim.SGD(compiled.parameters(), lr=0.05), loss_fn=_loss)
    message = str(caught.value)
    assert message.startswith(
        "pipeline: model Model was compiled with Dynamo by distopt.optimize ("
    )
    assert "if tokens.abs().mean() > 10.0" in message and "\n" not in message
