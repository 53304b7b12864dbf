"""Table shards and their update math, in-process (no RPC)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from distopt.errors import ConfigError
from distopt.ps.spec import TableSpec
from distopt.ps.table import ShardTable, accumulate, initial_rows


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
    opt = opt_cls(ref.parameters(), lr=0.3, **({"eps": spec.adagrad_eps} if optimizer == "adagrad" else {}))
    gen = torch.Generator().manual_seed(0)
    for ids in (torch.tensor([1, 3, 3, 7]), torch.tensor([3, 0, 7, 7, 7])):
        upstream = torch.randn(len(ids), 4, generator=gen)
        opt.zero_grad()
        (ref(ids) * upstream).sum().backward()
        opt.step()
        table.push(ids, upstream, lr=0.3)
    torch.testing.assert_close(table.fetch(torch.arange(10)), ref.weight.detach(), rtol=1e-6, atol=1e-7)


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


def test_push_rejects_mismatched_grads() -> None:
    table = ShardTable(TableSpec(name="t", num_rows=4, dim=2), shard=0, num_shards=1)
    with pytest.raises(ConfigError, match="3 gradient rows for 2 ids"):
        table.push(torch.tensor([0, 1]), torch.ones(3, 2), lr=1.0)
