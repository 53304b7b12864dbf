"""Cross-step prefetch on parameter-server models written in other people's styles.

The corpus models (:mod:`tests.remote.corpus`: the RPC tutorials' RRef helpers, RRef proxies,
``RemoteModule``, ``rpc.remote().to_here()``, calls by name, user-written ``rpc_async``, a chained
lookup, a six-table recommender) read their tables with the RPC idioms users write. The pipeline
must find the reads it can send a step ahead — every read whose ids come from the batch alone —
and train the local parameters exactly as the optimized model does without it.
"""

from __future__ import annotations

import importlib
import warnings

import pytest
import torch

import distopt
from distopt.pipeline import TrainPipeline, pipeline_split
from tests.remote.corpus import common, tables
from tests.remote.corpus.group import rpc_group

pytestmark = pytest.mark.slow

distopt.register_read(tables.lookup_rows)

# Reads that can run a step ahead, per idiom: the chained lookup's second read needs the first's
# rows, the recommender's chained table likewise; in reads_writes the write (a counter on ps0)
# precedes no read of its own resource, so both reads go ahead of the next step.
PREFETCHED = {
    "rref_helper": 2,
    "rref_proxy": 2,
    "remote_module": 2,
    "remote_to_here": 2,
    "by_name": 2,
    "user_async": 2,
    "chained": 1,
    "recommender": 5,
    "reads_writes": 2,
}


@pytest.fixture(scope="module")
def group():
    with rpc_group(2) as servers:
        yield servers


def _optimized(name: str, seed: int) -> torch.fx.GraphModule:
    model = importlib.import_module(f"tests.remote.corpus.{name}").build(seed=seed)
    with warnings.catch_warnings():
        warnings.simplefilter("error", distopt.DistoptFallbackWarning)
        gm = distopt.optimize(model, common.inputs(), config={"verify": {"remote_writes": True}})
    assert isinstance(gm, torch.fx.GraphModule)
    return gm


def _batches(steps: int = 5) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    return [(*common.inputs(seed=200 + s), common.targets(seed=200 + s)) for s in range(steps)]


@pytest.mark.parametrize("name", sorted(PREFETCHED))
def test_the_prefetch_stage_holds_every_read_that_needs_only_the_batch(group, name: str) -> None:
    split = pipeline_split(_optimized(name, seed=11))
    assert len(split.slots) == PREFETCHED[name], split.prefetch.code
    assert all(".py:" in slot for slot in split.slots)  # each names the user's source line


@pytest.mark.parametrize("name", ["rref_helper", "remote_module", "user_async", "recommender"])
@pytest.mark.parametrize("staleness", [0, 1])
def test_pipelined_training_equals_the_optimized_model(group, name: str, staleness: int) -> None:
    # The tables are only read (no DistributedOptimizer here), so any staleness is exact.
    expected = []
    gm = _optimized(name, seed=12)
    optimizer = torch.optim.SGD(gm.parameters(), lr=0.05)
    for dense, ids, target in _batches():
        optimizer.zero_grad()
        loss = common.loss(gm(dense, ids), target)
        loss.backward()
        optimizer.step()
        expected.append(loss.item())
    gm = _optimized(name, seed=12)
    pipe = TrainPipeline(
        gm,
        torch.optim.SGD(gm.parameters(), lr=0.05),
        iter(_batches()),
        staleness=staleness,
        inputs=lambda b: b[:2],
        loss_fn=lambda out, b: common.loss(out, b[2]),
    )
    assert [out.loss.item() for out in pipe.run()] == expected
    pipe.close()
