"""TrainPipeline on models we did not write: a TorchRec-style ranking model on distopt.ps tables
(features keyed to remote tables, jagged ids with offsets, pooled bags, an over-arch MLP), models
``distopt.optimize`` could not trace, and the refusals a user must get instead of other numerics."""

from __future__ import annotations

import copy
from collections.abc import Iterator

import pytest
import torch
import torch.distributed.rpc as rpc
from torch import nn

import distopt
import distopt.ps as ps
from distopt.errors import ConfigError
from distopt.pipeline import TrainPipeline, pipeline_split
from tests.pipeline.conftest import bitwise_equal
from tests.remote.corpus.tables import add_rows, lookup_rows

distopt.register_read(lookup_rows)

DIM = 8
ROWS = 24  # few rows: consecutive batches share rows, so a missed update is observable
TABLES = (
    ps.TableSpec(name="users", num_rows=ROWS, dim=DIM, optimizer="adagrad"),
    ps.TableSpec(name="items", num_rows=ROWS, dim=DIM),
)
# Two features share one table, as TorchRec's EmbeddingBagConfig(feature_names=[...]) allows.
FEATURES = {"user_id": "users", "item_id": "items", "item_history": "items"}
BATCH = 6
STEPS = 6


def sum_bags(rows: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Sum-pool jagged bags: bag ``b`` holds ``rows[offsets[b]:offsets[b + 1]]`` (may be empty)."""
    bag_of_row = torch.repeat_interleave(offsets[1:] - offsets[:-1])
    return rows.new_zeros(offsets.shape[0] - 1, rows.shape[-1]).index_add(0, bag_of_row, rows)


class RemoteBagCollection(nn.Module):
    """Like TorchRec's EmbeddingBagCollection: ``{feature: (values, offsets)}`` in, one pooled
    ``[B, DIM]`` per feature out; each feature's table lives on the parameter servers."""

    def __init__(self, features: dict[str, str]) -> None:
        super().__init__()
        self.lookups = nn.ModuleDict({f: ps.RemoteEmbedding(t, DIM) for f, t in features.items()})

    def forward(
        self, jagged: dict[str, tuple[torch.Tensor, torch.Tensor]]
    ) -> dict[str, torch.Tensor]:
        return {
            f: sum_bags(lookup(jagged[f][0]), jagged[f][1]) for f, lookup in self.lookups.items()
        }


class Ranker(nn.Module):
    """Dense arch, sparse arch, and an over arch on their concatenation (TorchRec's DLRM shape)."""

    def __init__(self) -> None:
        super().__init__()
        self.dense_arch = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, DIM))
        self.sparse_arch = RemoteBagCollection(FEATURES)
        self.over_arch = nn.Sequential(
            nn.Linear((1 + len(FEATURES)) * DIM, 16), nn.ReLU(), nn.Linear(16, 1)
        )

    def forward(self, dense: torch.Tensor, jagged: dict) -> torch.Tensor:
        pooled = self.sparse_arch(jagged)
        return self.over_arch(torch.cat([self.dense_arch(dense), *pooled.values()], dim=1))


def make_batch(seed: int) -> tuple[torch.Tensor, dict, torch.Tensor]:
    """``(dense, {feature: (values, offsets)}, labels)`` with 0..3 ids a bag."""
    gen = torch.Generator().manual_seed(seed)
    jagged = {}
    for feature in FEATURES:
        lengths = torch.randint(0, 4, (BATCH,), generator=gen)
        offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
        jagged[feature] = (torch.randint(0, ROWS, (int(offsets[-1]),), generator=gen), offsets)
    return torch.randn(BATCH, 4, generator=gen), jagged, torch.rand(BATCH, 1, generator=gen)


def _inputs(batch):
    return batch[:2]


def _loss(out, batch):
    return nn.functional.binary_cross_entropy_with_logits(out, batch[2])


def _push():
    ps.push_gradients(lr=0.5)


@pytest.fixture(scope="module")
def tables() -> Iterator[dict]:
    """Two servers holding the ranker's tables; yields their first state."""
    with ps.local_job(TABLES, ps.ServerOptions(num_servers=2, start_timeout_s=30)):
        yield copy.deepcopy(ps.state_dict())


def _optimized(with_example: bool) -> torch.fx.GraphModule:
    torch.manual_seed(0)
    example = _inputs(make_batch(0)) if with_example else None
    gm = distopt.optimize(
        Ranker(), example, strict=True, config={"verify": {"remote_writes": True}}
    )
    ps.discard_step()  # verification's fetches are no training step
    assert isinstance(gm, torch.fx.GraphModule)
    return gm


def _train(tables, with_example: bool, staleness: int | None):
    """Losses, dense parameters, optimizer state and tables after STEPS steps; ``staleness=None``
    trains the optimized model in a plain loop."""
    ps.load_state_dict(tables)
    gm = _optimized(with_example)
    opt = torch.optim.Adam(gm.parameters(), lr=0.01)
    batches = [make_batch(100 + s) for s in range(STEPS)]
    pipe = None
    if staleness is None:
        losses = []
        for batch in batches:
            opt.zero_grad(set_to_none=True)
            loss = _loss(gm(*_inputs(batch)), batch)
            loss.backward()
            _push()
            opt.step()
            losses.append(loss.item())
    else:
        pipe = TrainPipeline(
            gm, opt, iter(batches), staleness=staleness, loss_fn=_loss, inputs=_inputs, push=_push
        )
        losses = [out.loss.item() for out in pipe.run()]
        pipe.close()
    ps.flush()
    return (
        losses,
        copy.deepcopy(gm.state_dict()),
        copy.deepcopy(opt.state_dict()),
        ps.state_dict(),
        pipe,
    )


@pytest.mark.parametrize("with_example", [True, False], ids=["example", "no_example"])
def test_the_jagged_features_go_ahead_in_one_batched_fetch(tables, with_example) -> None:
    split = pipeline_split(_optimized(with_example))
    assert len(split.slots) == 1 and "fetch_batched" in split.slots[0]
    code = split.prefetch.code
    assert all(f"jagged['{feature}']" in code for feature in FEATURES), code
    assert "over_arch" not in code and "dense_arch" not in code


@pytest.mark.parametrize("with_example", [True, False], ids=["example", "no_example"])
def test_exact_mode_trains_the_ranker_bitwise_as_without_a_pipeline(tables, with_example) -> None:
    losses, params, opt_state, table_state, _ = _train(tables, with_example, staleness=None)
    p_losses, p_params, p_opt_state, p_tables, pipe = _train(tables, with_example, staleness=0)
    assert p_losses == losses
    assert bitwise_equal(p_params, params) and bitwise_equal(p_opt_state, opt_state)
    assert bitwise_equal(p_tables, table_state)  # rows and the Adagrad accumulators on the servers
    assert pipe.stats.batches == STEPS and pipe.stats.rows > 0 and pipe.stats.staleness_max == 0


def test_staleness_one_counts_the_updates_each_jagged_row_missed(tables) -> None:
    losses, *_ = _train(tables, True, staleness=None)
    p_losses, *_, pipe = _train(tables, True, staleness=1)
    stats = pipe.stats
    assert stats.staleness_max == 1 and 0 < stats.staleness_mean < 1, stats
    assert p_losses[0] == losses[0] and p_losses != losses


# ----------------------------------------------------------------------- models it cannot split


class ZerosPooling(Ranker):
    """Pools with ``torch.zeros(n, d)``: symbolic tracing cannot pass proxies as sizes, so
    distopt.optimize compiles this one with Dynamo."""

    def forward(self, dense, jagged):
        pooled = []
        for feature, lookup in self.sparse_arch.lookups.items():
            values, offsets = jagged[feature]
            rows = lookup(values)
            bags = torch.zeros(offsets.shape[0] - 1, DIM)
            pooled.append(
                bags.index_add(0, torch.repeat_interleave(offsets[1:] - offsets[:-1]), rows)
            )
        return self.over_arch(torch.cat([self.dense_arch(dense), *pooled], dim=1))


def _refusal(model: nn.Module, **kwargs) -> str:
    with pytest.raises(ConfigError) as caught:
        TrainPipeline(model, torch.optim.SGD(model.parameters(), lr=0.1), loss_fn=_loss, **kwargs)
    message = str(caught.value)
    assert "\n" not in message
    return message


def test_a_dynamo_compiled_model_is_refused_with_the_line_that_needed_dynamo() -> None:
    compiled = distopt.optimize(ZerosPooling())  # Dynamo compiles lazily: nothing runs here
    message = _refusal(compiled)
    assert message.startswith(
        "pipeline: model ZerosPooling was compiled with Dynamo by distopt.optimize ("
    )
    assert "bags = torch.zeros(offsets.shape[0] - 1, DIM)" in message
    assert message.endswith("the pipeline splits only symbolically traced graphs")


def test_a_model_returned_unoptimized_is_refused_saying_why() -> None:
    model = ZerosPooling()
    with pytest.warns(distopt.DistoptFallbackWarning):
        same = distopt.optimize(model, config={"capture": {"dynamo": False}})
    assert same is model
    message = _refusal(same)
    assert message.startswith(
        "pipeline: model ZerosPooling was returned unoptimized by distopt.optimize ("
    )
    assert "symbolic tracing failed" in message and message.endswith(
        "so there is no graph to split"
    )


def test_a_model_never_optimized_is_refused_with_what_to_do() -> None:
    assert _refusal(Ranker()) == (
        "pipeline: model Ranker is not a result of distopt.optimize, whose captured graph the "
        "pipeline splits; pass distopt.optimize(model, example_inputs)"
    )


class LearnedIds(nn.Module):
    """Reads rows at ids a layer computes: a step ahead that layer has other weights."""

    def __init__(self) -> None:
        super().__init__()
        self.route = nn.Linear(4, ROWS)
        self.emb = ps.RemoteEmbedding("users", DIM)
        self.head = nn.Linear(DIM, 1)

    def forward(self, dense):
        return self.head(self.emb(self.route(dense).argmax(dim=1)))


def test_a_model_whose_reads_need_its_parameters_is_refused_naming_the_read() -> None:
    message = _refusal(distopt.optimize(LearnedIds()))
    assert message.startswith(
        "pipeline: model LearnedIds has 1 remote read(s) but none whose arguments come from its "
        "inputs alone (first: "
    )
    assert "self.emb(self.route(dense).argmax(dim=1))" in message and message.endswith(
        "nothing to prefetch"
    )


# ------------------------------------------- user RPC reads: staleness the pipeline cannot count
# Built by distopt.optimize without example inputs, so no server runs: the refusals come from
# the graph, before any step.


class ReadThenWrite(nn.Module):
    """Reads rows of ``t0`` by name, then writes those rows (a user RPC the passes see)."""

    def __init__(self, write_table: str = "t0") -> None:
        super().__init__()
        self.write_table = write_table
        self.head = nn.Linear(16, 1)

    def forward(self, ids):
        rows = rpc.rpc_sync("ps0", lookup_rows, args=("t0", ids))
        rpc.rpc_sync("ps0", add_rows, args=(self.write_table, ids, 0.1))
        return self.head(rows)


def _pipeline(model: nn.Module, staleness: int, push) -> TrainPipeline:
    gm = distopt.optimize(model)
    return TrainPipeline(
        gm,
        torch.optim.SGD(gm.parameters(), lr=0.1),
        iter([]),
        staleness=staleness,
        loss_fn=_loss,
        push=push,
    )


def test_user_rpc_reads_ahead_of_an_unseen_push_are_refused() -> None:
    with pytest.raises(ConfigError) as caught:
        _pipeline(ReadThenWrite(), staleness=1, push=lambda: None)
    message = str(caught.value)
    assert message.startswith(
        "pipeline: model ReadThenWrite: staleness=1 cannot count what the read "
    )
    assert 'rows = rpc.rpc_sync("ps0", lookup_rows, args=("t0", ids))' in message
    assert "it would run before push=" in message and message.endswith("use staleness=0 (exact)")
    assert "\n" not in message


def test_user_rpc_reads_two_steps_ahead_of_a_conflicting_write_are_refused() -> None:
    with pytest.raises(ConfigError) as caught:
        _pipeline(ReadThenWrite(), staleness=2, push=None)
    message = str(caught.value)
    assert "it would run before the write " in message and "add_rows" in message
    assert message.endswith("use staleness <= 1") and "\n" not in message


@pytest.mark.parametrize(
    ("model", "staleness", "push"),
    [
        (ReadThenWrite(), 0, lambda: None),  # exact: prefetched after the forward and push
        (ReadThenWrite(), 1, None),  # the forward's write is waited before the prefetch
        (ReadThenWrite(write_table="t1"), 2, None),  # the write touches another table
    ],
    ids=["exact_with_push", "one_ahead_of_the_forward_write", "write_elsewhere"],
)
def test_user_rpc_reads_that_cross_no_unseen_write_are_accepted(model, staleness, push) -> None:
    assert len(_pipeline(model, staleness, push).split.slots) == 1
