"""split_prefetch: which remote reads run a batch ahead, and what the two stages compute."""

from __future__ import annotations

import pytest
import torch
import torch.fx
from torch import nn

import distopt
import distopt.ps as ps
from distopt.errors import ConfigError
from distopt.models.dlrm import make_batch
from distopt.pipeline import PipelineError, pipeline_split, provided, split_prefetch
from tests.pipeline.conftest import CONFIG, optimized_dlrm


def _slots(gm: torch.fx.GraphModule) -> list[str]:
    return [
        str(n.target.__name__)
        for n in gm.graph.nodes
        if n.op == "call_function" and hasattr(n.target, "_distopt_prefetch_slot")
    ]


def test_the_batched_read_of_every_table_is_the_prefetch_stage(server) -> None:
    batch = make_batch(CONFIG, 0)
    gm = optimized_dlrm((batch.dense, batch.sparse))
    split = split_prefetch(gm)
    assert _slots(split.main) == ["prefetched_0_fetch_batched"]
    assert "bottom" not in split.prefetch.code and "fetch_batched" in split.prefetch.code
    assert len(split.slots) == 1 and "dlrm.py" in split.slots[0]
    with torch.no_grad():
        issued = split.prefetch(batch.dense, batch.sparse)
        ((future, args, kwargs),) = issued
        with provided(issued):
            pipelined = split.main(batch.dense, batch.sparse)
        ps.discard_step()
        assert torch.equal(pipelined, gm(batch.dense, batch.sparse))
        # The main stage alone issues as written (evaluation, a model used without a pipeline).
        assert torch.equal(split.main(batch.dense, batch.sparse), pipelined)
    ps.discard_step()
    assert args[0][0][0] == "emb0" and torch.equal(args[0][0][1], batch.sparse[0])


def test_rows_prefetched_for_another_batch_are_refused(server) -> None:
    one, two = make_batch(CONFIG, 1), make_batch(CONFIG, 2)
    split = split_prefetch(optimized_dlrm((one.dense, one.sparse)))
    with torch.no_grad(), provided(split.prefetch(one.dense, one.sparse)):
        with pytest.raises(PipelineError, match="other arguments than the batch in hand"):
            split.main(two.dense, two.sparse)
    ps.flush()
    ps.discard_step()


class Chained(nn.Module):
    """The second table's ids come from the first table's rows (a chained lookup)."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        first = ps.fetch("emb0", ids)
        second = ps.fetch("emb1", first.argmax(dim=-1))
        return first.sum() + second.sum()


class ReadAfterWrite(nn.Module):
    """A push in the forward, then a read of the same table: the read must see the push."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        zero_grads = ids.unsqueeze(-1).float().expand(-1, CONFIG.embedding_dim) * 0
        ps.push("emb0", ids, zero_grads, lr=0.0)
        return ps.fetch("emb0", ids).sum() + ps.fetch("emb1", ids).sum()


class ParameterIds(nn.Module):
    """Ids computed from a parameter (it changes every step, so they cannot be computed ahead)."""

    def __init__(self) -> None:
        super().__init__()
        self.shift = nn.Parameter(torch.zeros(()))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        moved = (ids + self.shift.detach().long()) % CONFIG.num_rows
        return ps.fetch("emb0", moved).sum() + ps.fetch("emb1", ids).sum()


@pytest.mark.parametrize(
    ("model", "kept"),
    [(Chained, ["emb0"]), (ReadAfterWrite, ["emb1"]), (ParameterIds, ["emb1"])],
)
def test_reads_that_cannot_run_ahead_stay_in_the_main_stage(server, model, kept) -> None:
    ids = torch.tensor([1, 2, 3])
    gm = distopt.optimize(
        model(),
        (ids,),
        passes=["split_remote"],
        strict=True,
        config={"verify": {"remote_writes": True}},
    )
    ps.discard_step()
    split = split_prefetch(gm)
    issues = [
        n
        for n in split.prefetch.graph.nodes
        if n.op == "call_function" and "fetch" in str(n.target)
    ]
    assert [n.args[0] for n in issues] == kept, split.prefetch.code
    ps.load_state_dict(server)


class Local(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2


def test_a_model_without_remote_reads_is_a_one_line_error_naming_it() -> None:
    with pytest.raises(
        ConfigError, match=r"^pipeline: model Local has no remote read; nothing to prefetch$"
    ):
        pipeline_split(torch.fx.symbolic_trace(Local()))
    with pytest.raises(
        ConfigError, match=r"^pipeline: model Local is not a result of distopt.optimize"
    ):
        pipeline_split(Local())


def test_explain_shows_the_prefetch_stage_next_to_the_main_stage(server) -> None:
    batch = make_batch(CONFIG, 3)
    main = pipeline_split(optimized_dlrm((batch.dense, batch.sparse))).main
    text = distopt.explain(main)
    assert "pipeline: 1 read prefetched a step ahead" in text
    assert "slot 0: fetch_batched: " in text and "ps.fetch(self.tables[k], sparse[k])" in text
    assert "prefetch stage:" in text and "distopt_ps_client_registration_fetch_batched" in text
