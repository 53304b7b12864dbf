"""Table shards and their update math, in-process (no RPC)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from distopt.errors import ConfigError
from distopt.ps.server.table import (
    ShardTable,
    accumulate,
    grads_nbytes,
    initial_rows,
    pack_rows,
    unpack_rows,
)
from distopt.ps.spec import TableSpec


def _whole(spec: TableSpec, num_shards: int, seed: int = 0) -> list[ShardTable]:
    return [ShardTable(spec, shard=s, num_shards=num_shards, seed=seed) for s in range(num_shards)]


def test_initial_rows_are_seeded_and_independent_of_sharding() -> None:
    spec = TableSpec(name="t", num_rows=11, dim=3)
    full = initial_rows(spec, seed=5)
    assert torch.equal(full, initial_rows(spec, seed=5))
    assert not torch.equal(full, initial_rows(spec, seed=6))
    shards = _whole(spec, 3, seed=5)
    ids = torch.arange(11)
    for shard in shards:
        mine = ids[ids % 3 == shard.shard]
        assert torch.equal(shard.fetch(mine), full[mine])


def test_accumulate_sums_duplicate_ids() -> None:
    ids = torch.tensor([4, 1, 4, 4])
    grads = torch.tensor([[1.0], [2.0], [3.0], [4.0]])
    unique, summed = accumulate(ids, grads)
    assert unique.tolist() == [1, 4]
    assert summed.flatten().tolist() == [2.0, 8.0]


@pytest.mark.parametrize("optimizer", ["sgd", "adagrad"])
def test_sparse_update_matches_torch_optimizer(optimizer: str) -> None:
    """Two pushes with duplicate ids equal torch's sparse SGD/Adagrad on nn.Embedding(sparse=True)."""
    spec = TableSpec(name="t", num_rows=10, dim=4, optimizer=optimizer)
    table = ShardTable(spec, shard=0, num_shards=1, seed=1)
    ref = nn.Embedding(10, 4, sparse=True)
    ref.weight.data.copy_(initial_rows(spec, seed=1))
    opt_cls = torch.optim.SGD if optimizer == "sgd" else torch.optim.Adagrad
    opt = opt_cls(
        ref.parameters(), lr=0.3, **({"eps": spec.adagrad_eps} if optimizer == "adagrad" else {})
    )
    gen = torch.Generator().manual_seed(0)
    for ids in (torch.tensor([1, 3, 3, 7]), torch.tensor([3, 0, 7, 7, 7])):
        upstream = torch.randn(len(ids), 4, generator=gen)
        opt.zero_grad()
        (ref(ids) * upstream).sum().backward()
        opt.step()
        table.push(ids, upstream, lr=0.3)
    torch.testing.assert_close(
        table.fetch(torch.arange(10)), ref.weight.detach(), rtol=1e-6, atol=1e-7
    )


def test_sharded_push_equals_unsharded_push() -> None:
    spec = TableSpec(name="t", num_rows=9, dim=2, optimizer="adagrad")
    one = ShardTable(spec, shard=0, num_shards=1)
    two = _whole(spec, 2)
    ids = torch.tensor([0, 1, 2, 2, 5, 8])
    grads = torch.randn(6, 2)
    one.push(ids, grads, lr=0.1)
    for shard in two:
        mask = ids % 2 == shard.shard
        shard.push(ids[mask], grads[mask], lr=0.1)
    everything = torch.arange(9)
    merged = torch.empty(9, 2)
    for shard in two:
        mine = everything[everything % 2 == shard.shard]
        merged[mine] = shard.fetch(mine)
    torch.testing.assert_close(merged, one.fetch(everything))


def test_fetch_returns_a_copy() -> None:
    table = ShardTable(TableSpec(name="t", num_rows=3, dim=2), shard=0, num_shards=1)
    before = table.fetch(torch.tensor([1]))
    table.push(torch.tensor([1]), torch.ones(1, 2), lr=1.0)
    assert not torch.equal(before, table.fetch(torch.tensor([1])))


def test_state_dict_round_trip() -> None:
    spec = TableSpec(name="t", num_rows=6, dim=2, optimizer="adagrad")
    a = ShardTable(spec, shard=1, num_shards=2)
    a.push(torch.tensor([1, 3]), torch.ones(2, 2), lr=0.5)
    b = ShardTable(spec, shard=1, num_shards=2)
    b.load_state_dict(a.state_dict())
    assert torch.equal(b.weight, a.weight) and torch.equal(b.accum, a.accum)
    with pytest.raises(ConfigError, match="shard 0 of 2"):
        ShardTable(spec, shard=0, num_shards=2).load_state_dict(a.state_dict())


@pytest.mark.parametrize(
    ("ids", "message"),
    [
        (torch.tensor([6]), "row id 6 outside 0..5"),
        (torch.tensor([-1]), "row id -1 outside"),
        (torch.tensor([2]), "row id 2 belongs to shard 0, not shard 1"),
        (torch.tensor([1.0]), "ids must be an integer tensor"),
    ],
)
def test_bad_ids_name_the_table_and_id(ids: torch.Tensor, message: str) -> None:
    table = ShardTable(TableSpec(name="clicks", num_rows=6, dim=2), shard=1, num_shards=2)
    with pytest.raises(ConfigError, match=f"table 'clicks': {message}"):
        table.fetch(ids)


@pytest.mark.parametrize(
    "grads", [torch.ones(3, 2), torch.ones(5), torch.ones(2, 2, dtype=torch.int64)]
)
def test_push_rejects_mismatched_grads_before_touching_the_rows(grads: torch.Tensor) -> None:
    table = ShardTable(TableSpec(name="t", num_rows=4, dim=2), shard=0, num_shards=1)
    before = table.weight.clone()
    with pytest.raises(ConfigError, match=r"^table 't': grads (of shape|must be a float tensor)"):
        table.push(torch.tensor([0, 1]), grads, lr=1.0)
    assert torch.equal(table.weight, before)


def _bags(bags: int, size: int, dim: int, seed: int = 0) -> torch.Tensor:
    """Gradient rows of ``bags`` sum-pooled bags of ``size`` ids: each bag's rows are equal."""
    pooled = torch.randn(bags, dim, generator=torch.Generator().manual_seed(seed))
    return pooled.repeat_interleave(size, dim=0)


def test_pack_rows_sends_one_row_per_run_of_equal_rows_and_unpacks_the_same_bits() -> None:
    rows = _bags(5, 4, 8)
    rows[4:8] = -0.0  # a bag of -0.0 rows, then a +0.0 row: bitwise different, not one run
    rows[8] = 0.0
    rows[12:16] = float("nan")  # equal bits: one run
    packed = pack_rows(rows)
    assert isinstance(packed, tuple)
    distinct, repeats = packed
    assert repeats.tolist() == [4, 4, 1, 3, 4, 4] and distinct.shape == (6, 8)
    assert grads_nbytes(packed) == 6 * 8 * 4 + 6 * 4 < grads_nbytes(rows)
    assert torch.equal(unpack_rows(packed).view(torch.int32), rows.view(torch.int32))


@pytest.mark.parametrize(
    "rows",
    [torch.randn(6, 4), torch.ones(1, 4), torch.ones(2, 1), torch.zeros(0, 4)],
    ids=["distinct", "one row", "a 1-wide row saves less than its count", "empty"],
)
def test_pack_rows_keeps_rows_it_cannot_shrink(rows: torch.Tensor) -> None:
    assert pack_rows(rows) is rows


@pytest.mark.parametrize("optimizer", ["sgd", "adagrad", "rowwise_adagrad"])
def test_a_packed_push_updates_the_rows_bitwise_as_the_plain_push(optimizer: str) -> None:
    spec = TableSpec(name="t", num_rows=40, dim=8, optimizer=optimizer)
    plain, packed = _whole(spec, 1, seed=2) + _whole(spec, 1, seed=2)
    ids = torch.randint(0, 40, (48,), generator=torch.Generator().manual_seed(1))  # duplicates
    for step in range(3):
        grads = _bags(12, 4, 8, seed=step)
        _, before, run = plain.push(ids, grads, lr=0.3)
        _, packed_before, packed_run = packed.push(ids, pack_rows(grads), lr=0.3)
        assert torch.equal(before, packed_before) and torch.equal(run, packed_run)
    assert torch.equal(plain.weight, packed.weight)
    assert plain.accum is None or torch.equal(plain.accum, packed.accum)


@pytest.mark.parametrize(
    "grads",
    [
        (torch.ones(2, 2), torch.tensor([1, 2], dtype=torch.int32)),  # 3 rows for 4 ids
        (torch.ones(2, 2), torch.tensor([4, 0], dtype=torch.int32)),
        (torch.ones(2, 2), torch.tensor([4.0])),
        (torch.ones(2, 2),),
    ],
    ids=["short", "a zero count", "float counts", "no counts"],
)
def test_bad_packed_grads_are_a_one_line_error_before_touching_the_rows(grads: tuple) -> None:
    table = ShardTable(TableSpec(name="t", num_rows=4, dim=2), shard=0, num_shards=1)
    before = table.weight.clone()
    with pytest.raises(ConfigError, match=r"^table 't': (packed )?grads [^\n]*$"):
        table.push(torch.tensor([0, 1, 2, 3]), grads, lr=1.0)
    assert torch.equal(table.weight, before)


def _rowwise_adagrad_reference(
    weight: torch.Tensor, pushes: list[tuple[torch.Tensor, torch.Tensor]], lr: float, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Row-wise Adagrad written out row by row (FBGEMM's EXACT_ROWWISE_ADAGRAD): duplicate ids sum
    first; each touched row adds the mean of its squared gradient to one scalar accumulator."""
    weight = weight.clone().double()
    state = torch.zeros(weight.shape[0], dtype=torch.float64)
    for ids, grads in pushes:
        for row in sorted(set(ids.tolist())):
            g = grads.double()[ids == row].sum(dim=0)
            state[row] += (g * g).mean()
            weight[row] -= lr * g / (state[row].sqrt() + eps)
    return weight, state


def test_rowwise_adagrad_matches_reference() -> None:
    spec = TableSpec(name="t", num_rows=10, dim=4, optimizer="rowwise_adagrad")
    table = ShardTable(spec, shard=0, num_shards=1, seed=1)
    assert table.accum is not None and table.accum.shape == (10,)  # one scalar per row
    gen = torch.Generator().manual_seed(0)
    pushes = [
        (ids, torch.randn(len(ids), 4, generator=gen))
        for ids in (torch.tensor([1, 3, 3, 7]), torch.tensor([3, 0, 7, 7, 7]), torch.tensor([9]))
    ]
    for ids, grads in pushes:
        table.push(ids, grads, lr=0.3)
    weight, state = _rowwise_adagrad_reference(
        initial_rows(spec, seed=1), pushes, 0.3, spec.adagrad_eps
    )
    torch.testing.assert_close(table.fetch(torch.arange(10)), weight.float(), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(table.accum, state.float(), rtol=1e-6, atol=1e-7)


def test_rowwise_adagrad_differs_from_elementwise_adagrad() -> None:
    ids, grads = torch.tensor([2]), torch.tensor([[1.0, 3.0]])
    tables = {
        opt: ShardTable(
            TableSpec(name="t", num_rows=4, dim=2, optimizer=opt), shard=0, num_shards=1
        )
        for opt in ("adagrad", "rowwise_adagrad")
    }
    for table in tables.values():
        table.push(ids, grads, lr=1.0)
    moved = {opt: initial_rows(t.spec, 0)[2] - t.fetch(ids)[0] for opt, t in tables.items()}
    torch.testing.assert_close(moved["adagrad"], torch.ones(2))  # sign(g): per-element scaling
    torch.testing.assert_close(moved["rowwise_adagrad"], grads[0] / 5.0**0.5)  # sqrt(mean(1, 9))


def test_rowwise_adagrad_state_round_trip_and_mismatch() -> None:
    spec = TableSpec(name="t", num_rows=6, dim=3, optimizer="rowwise_adagrad")
    a = ShardTable(spec, shard=0, num_shards=2)
    a.push(torch.tensor([0, 4, 4]), torch.randn(3, 3), lr=0.5)
    b = ShardTable(spec, shard=0, num_shards=2)
    b.load_state_dict(a.state_dict())
    assert torch.equal(b.weight, a.weight) and torch.equal(b.accum, a.accum)
    # Continuing from the checkpoint equals continuing the original.
    for table in (a, b):
        table.push(torch.tensor([2, 4]), torch.ones(2, 3), lr=0.5)
    assert torch.equal(b.weight, a.weight) and torch.equal(b.accum, a.accum)
    elementwise = ShardTable(
        TableSpec(name="t", num_rows=6, dim=3, optimizer="adagrad"), shard=0, num_shards=2
    )
    with pytest.raises(
        ConfigError, match=r"shape \(3, 3\) does not match optimizer 'rowwise_adagrad'"
    ):
        b.load_state_dict(elementwise.state_dict())
    sgd = ShardTable(TableSpec(name="t", num_rows=6, dim=3), shard=0, num_shards=2)
    with pytest.raises(ConfigError, match="optimizer state none does not match"):
        b.load_state_dict(sgd.state_dict())


@pytest.mark.parametrize("optimizer", ["sgd", "adagrad"])
def test_a_dry_run_push_holds_the_lock_as_long_as_a_push_and_changes_nothing(
    optimizer: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fetch waits behind a push's update math; it must wait as long behind a dry run's, or a
    rehearsed pipeline takes its prefetched batches sooner than the job does."""
    from distopt.ps.server import table as table_module

    spec = TableSpec(name="t", num_rows=8, dim=2, optimizer=optimizer)
    shard = ShardTable(spec, shard=0, num_shards=1, seed=3)
    before = shard.state_dict()
    held = []
    step_rows = table_module.step_rows

    def watched(*args, **kwargs):
        held.append(shard.lock.locked())
        return step_rows(*args, **kwargs)

    monkeypatch.setattr(table_module, "step_rows", watched)
    ids, grads = torch.tensor([1, 5, 1]), torch.ones(3, 2)
    shard.rehearse(*shard.checked(ids, grads), lr=0.1)
    after = shard.state_dict()
    assert all(torch.equal(after[k], v) for k, v in before.items() if isinstance(v, torch.Tensor))
    shard.push(ids, grads, lr=0.1)
    assert held == [True, True]  # the dry run's math, then the push's, each under the lock


_SPECIAL = [-0.0, 0.0, float("nan"), float("inf"), -float("inf"), 1e-45, -1e-45, 3.0e38]


@settings(max_examples=60, deadline=None)
@given(
    optimizer=st.sampled_from(["sgd", "adagrad", "rowwise_adagrad"]),
    lr=st.one_of(st.sampled_from([0.0, -0.0, 0.1, -0.1]), st.floats(-10, 10)),
    grad=st.one_of(st.sampled_from(_SPECIAL), st.floats(-1e3, 1e3)),
    ids=st.lists(st.integers(0, 11), min_size=1, max_size=20),
)
def test_a_dry_run_push_runs_a_pushs_kernels_on_the_shard_and_leaves_every_bit(
    optimizer: str, lr: float, grad: float, ids: list[int]
) -> None:
    """A dry run updates the shard's own rows as a push does (the cost of writing rows spread over
    tables larger than the CPU's caches is the cost of a push) and leaves the shard bitwise as it
    was: signed zeros, NaN and infinities in the rows, any learning rate, any gradient."""
    from unittest import mock

    from distopt.ps.server import table as table_module

    shard = ShardTable(
        TableSpec(name="t", num_rows=12, dim=2, optimizer=optimizer), shard=0, num_shards=1
    )
    shard.weight[: len(_SPECIAL), 0] = torch.tensor(_SPECIAL)
    if shard.accum is not None:
        shard.accum.view(-1)[:3] = torch.tensor([-0.0, 1e-45, 0.5])
    before = {k: v.clone() for k, v in shard.state_dict().items() if isinstance(v, torch.Tensor)}
    version = shard.version.clone()
    grads = torch.full((len(ids), 2), grad)
    with mock.patch.object(table_module, "step_rows", wraps=table_module.step_rows) as step:
        shard.rehearse(*shard.checked(torch.tensor(ids), grads), lr=lr)
    ((args, kwargs),) = step.call_args_list
    assert args[1] is shard.weight and args[2] is shard.accum and kwargs == {"dry": True}
    assert torch.equal(args[3], torch.tensor(sorted(set(ids))))  # the rows a push updates
    after = shard.state_dict()
    for key, value in before.items():
        assert torch.equal(after[key].view(torch.int32), value.view(torch.int32)), key
    assert torch.equal(shard.version, version)
