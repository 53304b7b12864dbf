import pytest
import torch
from torch import nn

import distopt
from distopt.passes import run_passes
from distopt.passes.core.pass_base import resolve_pipeline
from distopt.remote.wait import is_wait
from tests.passes.remote import inprocess_server as ps
from tests.passes.remote.inprocess_server import STORE, fetch, fetch_async, fetch_many_async, push

PASSES = ["split_remote", "hoist_issue", "batch_fetch", "sink_wait"]


@pytest.fixture(autouse=True)
def _fresh_store() -> None:
    STORE.reset()


def _calls(gm: torch.fx.GraphModule, target: object) -> list[torch.fx.Node]:
    return [n for n in gm.graph.nodes if n.target is target]


class ManyTables(nn.Module):
    """Fetches of t0 and t1 (server s0) and t2 (server s1), written between dense layers."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(ps.DIM, ps.DIM)

    def forward(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        a = fetch("t0", ids[:, 0])
        h = self.fc(x)
        b = fetch("t2", ids[:, 1])
        c = fetch("t1", ids[:, 2])
        d = fetch("t0", ids[:, 3])
        return h + a + b + c + d


def _inputs() -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(5, ps.DIM), torch.randint(0, ps.ROWS, (5, 4))


def test_concurrent_reads_of_one_server_become_one_request() -> None:
    model, inputs = ManyTables(), _inputs()
    gm = distopt.optimize(model, inputs, passes=PASSES, strict=True)
    batched = _calls(gm, fetch_many_async)
    assert len(batched) == 1 and len(batched[0].args[0]) == 3  # t0, t1, t0 on server s0
    assert len(_calls(gm, fetch_async)) == 1  # t2 lives alone on s1
    waits = [n for n in gm.graph.nodes if is_wait(n)]
    assert sorted(w.kwargs.get("item") for w in waits if w.args[0] is batched[0]) == [0, 1, 2]
    STORE.reset()
    expected = model(*inputs)
    assert STORE.requests == 4
    STORE.reset()
    torch.testing.assert_close(gm(*inputs), expected)
    assert STORE.requests == 2


class ReadWriteRead(nn.Module):
    def forward(self, x: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, ...]:
        a = fetch("t0", ids[:, 0])
        push("t1", ids[:, 0], x)
        b = fetch("t1", ids[:, 1])  # must see the push: cannot join the first read
        c = fetch("t0", ids[:, 2])  # t0 is not written: joins the first read
        return a, b, c


def test_a_conflicting_write_splits_the_batch() -> None:
    gm = distopt.optimize(ReadWriteRead(), _inputs(), passes=PASSES, verify=False, strict=True)
    batched = _calls(gm, fetch_many_async)
    assert len(batched) == 1
    tables = [args[0] for args in batched[0].args[0]]
    assert tables == ["t0", "t0"]
    single = _calls(gm, fetch_async)
    assert [n.args[0] for n in single] == ["t1"]
    order = [n.name for n in gm.graph.nodes]
    assert order.index("push_wait") < order.index(single[0].name)


def test_results_after_a_write_match_the_unoptimized_model() -> None:
    model, inputs = ReadWriteRead(), _inputs()
    expected = model(*inputs)
    STORE.reset()
    gm = distopt.optimize(model, inputs, passes=PASSES, verify=False, strict=True)
    for got, want in zip(gm(*inputs), expected, strict=True):
        torch.testing.assert_close(got, want)


class EightReads(nn.Module):
    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = [fetch("t0", ids[:, i]) for i in range(8)]
        return torch.stack(rows).sum(0)


def _batch_sizes(gm: torch.fx.GraphModule) -> list[int]:
    sizes = [len(n.args[0]) for n in _calls(gm, fetch_many_async)]
    return sizes + [1] * len(_calls(gm, fetch_async))


def test_max_batch_requests_limits_each_batch() -> None:
    ids = torch.randint(0, ps.ROWS, (4, 8))
    config = {"pass_options": {"batch_fetch": {"max_batch_requests": 3}}}
    gm = distopt.optimize(EightReads(), (ids,), passes=PASSES, config=config, strict=True)
    assert sorted(_batch_sizes(gm)) == [2, 3, 3]


def test_max_batch_bytes_uses_the_ids_size_of_the_example_inputs() -> None:
    ids = torch.randint(0, ps.ROWS, (4, 8))  # each request sends 4 int64 ids = 32 bytes
    config = {"pass_options": {"batch_fetch": {"max_batch_bytes": 100}}}
    gm = distopt.optimize(EightReads(), (ids,), passes=PASSES, config=config, strict=True)
    assert sorted(_batch_sizes(gm)) == [2, 3, 3]


def test_bad_limit_names_the_option() -> None:
    config = {"pass_options": {"batch_fetch": {"max_batch_requests": 0}}}
    with pytest.raises(distopt.PassError, match="pass_options.batch_fetch.max_batch_requests.*0"):
        distopt.optimize(
            EightReads(),
            (torch.zeros(4, 8, dtype=torch.long),),
            passes=PASSES,
            config=config,
            strict=True,
        )


def test_batching_is_idempotent_and_survives_retracing() -> None:
    from distopt.capture.tracer import DistoptTracer

    inputs = _inputs()
    gm = distopt.optimize(ManyTables(), inputs, passes=PASSES, strict=True)
    code = gm.code
    record = run_passes(gm, resolve_pipeline(PASSES))
    assert gm.code == code and not any(p.modified for p in record.passes)
    STORE.reset()
    again = torch.fx.GraphModule(gm, DistoptTracer().trace(gm))
    assert STORE.requests == 0
    run_passes(again, resolve_pipeline(PASSES))
    assert len(_calls(again, fetch_many_async)) == 1
    torch.testing.assert_close(again(*inputs), gm(*inputs))


class WriteBetweenWaits(nn.Module):
    """A read of t1, a write of t1, then a read of t0 (hoisted next to the first read)."""

    def forward(self, x: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, ...]:
        a = fetch("t1", ids[:, 0])
        push("t1", ids[:, 0], x)
        b = fetch("t0", ids[:, 1])
        return a, b, torch.tanh(x)


def test_reads_are_not_batched_across_a_write_that_conflicts_with_one_of_them() -> None:
    # Batched, the t0 read's wait would sit after the t1 write that must follow the t1 read.
    gm = distopt.optimize(WriteBetweenWaits(), _inputs(), passes=PASSES, verify=False, strict=True)
    assert not _calls(gm, fetch_many_async)
    order = [n.name for n in gm.graph.nodes]
    assert order.index("fetch_1_issue") < order.index("push_issue")  # still hoisted
    record = run_passes(gm, resolve_pipeline(PASSES))
    assert not any(p.modified for p in record.passes)
