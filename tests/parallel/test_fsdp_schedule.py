"""The FSDP2 schedule planner: fewer all-gathers within a bounded memory increase."""

import torch
import torch.fx
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from distopt.models import build
from distopt.optimize import optimize
from distopt.parallel.apply import backward_free_units
from distopt.parallel.fsdp_schedule import leanest_schedule, plan_fsdp_schedule
from distopt.parallel.units import materialize_units, unit_modules

MIB = 2**20
GPT = [24 * MIB] + [27 * MIB] * 14 + [24 * MIB]  # embeddings, 14 blocks, norm + head


def test_leanest_gathers_every_unit_twice_but_the_last() -> None:
    lean = leanest_schedule(GPT, world_size=2)
    assert lean.root_held == frozenset() and lean.keep_after_forward == {15}
    assert lean.gathered_bytes == 2 * sum(GPT) - GPT[-1]
    assert lean.memory_bytes == sum(GPT) // 2 + 54 * MIB  # shards + two blocks (prefetch)


def test_no_slack_still_keeps_what_fits_under_the_peak() -> None:
    # Head (24) + last block (27) held across the turn is less than the two-block peak (54).
    plan = plan_fsdp_schedule(GPT, world_size=2, memory_slack=0.0)
    assert plan.keep_after_forward == {14, 15}
    assert plan.memory_bytes == leanest_schedule(GPT, world_size=2).memory_bytes


def test_gpt_keeps_its_last_units_across_the_turn() -> None:
    lean = leanest_schedule(GPT, world_size=2)
    plan = plan_fsdp_schedule(GPT, world_size=2, memory_slack=0.2)
    assert plan.keep_after_forward == {12, 13, 14, 15}
    assert plan.gathered_bytes == lean.gathered_bytes - 81 * MIB  # three block gathers saved
    assert plan.memory_bytes <= 1.2 * lean.memory_bytes


def test_a_backward_free_unit_is_gathered_once_at_no_memory_cost() -> None:
    # Embeddings: backward needs their indices, not their table, so FSDP2 need not gather it again.
    plain = plan_fsdp_schedule(GPT, world_size=2, memory_slack=0.2)
    free = plan_fsdp_schedule(GPT, world_size=2, memory_slack=0.2, backward_free={0})
    assert free.backward_free == {0} and free.keep_after_forward == plain.keep_after_forward
    assert free.gathered_bytes == plain.gathered_bytes - GPT[0]
    assert free.memory_bytes == plain.memory_bytes
    # Fewer bytes than the per-block policy (root holds embeddings and head, last block kept).
    per_block = sum(GPT[0::15]) + 2 * sum(GPT[1:14]) + GPT[14]
    assert free.gathered_bytes < per_block


def test_a_small_leading_unit_goes_to_the_root() -> None:
    # Tiny embeddings: holding them all step costs little and saves their backward gather. (The
    # tiny head is kept across the turn instead: gathered once either way.)
    sizes = [1 * MIB] + [100 * MIB] * 4 + [1 * MIB]
    plan = plan_fsdp_schedule(sizes, world_size=8, memory_slack=0.05)
    assert 0 in plan.root_held and 5 in plan.root_held | plan.keep_after_forward


def test_a_huge_vocabulary_is_never_held_by_the_root() -> None:
    sizes = [2048 * MIB] + [200 * MIB] * 8 + [2048 * MIB]
    plan = plan_fsdp_schedule(sizes, world_size=8, memory_slack=0.2)
    assert not plan.root_held


@settings(max_examples=200, deadline=None)
@given(
    sizes=st.lists(st.integers(min_value=0, max_value=10**9), min_size=1, max_size=24),
    world=st.integers(min_value=1, max_value=64),
    slack=st.floats(min_value=0.0, max_value=1.0),
)
def test_never_worse_than_the_leanest_and_within_the_budget(sizes, world, slack) -> None:
    lean = leanest_schedule(sizes, world_size=world)
    plan = plan_fsdp_schedule(sizes, world_size=world, memory_slack=slack)
    assert plan.gathered_bytes <= lean.gathered_bytes
    assert plan.memory_bytes <= lean.memory_bytes * (1 + slack)
    assert plan.root_held <= {0, len(sizes) - 1}
    sharded = [i for i in range(len(sizes)) if i not in plan.root_held]
    kept = sorted(plan.keep_after_forward)
    assert kept == sharded[len(sharded) - len(kept) :] and (not sharded or sharded[-1] in kept)


def test_only_embedding_units_are_backward_free() -> None:
    torch.manual_seed(0)
    model = build("gpt", vocab_size=64, dim=32, heads=2, layers=2, seq_len=16, dropout=0.0)
    gm = optimize(
        model,
        None,
        passes=["partition", "fuse_units"],
        config={"pass_options": {"partition": {}, "fuse_units": {"min_unit_bytes": 0}}},
        verify=False,
    )
    units = unit_modules(materialize_units(gm))
    assert len(units) == 4  # embeddings, 2 blocks, norm + head
    assert backward_free_units(units) == {0}


def test_a_table_read_outside_its_embedding_is_not_backward_free() -> None:
    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.tok = nn.Embedding(16, 8)

        def forward(self, idx: torch.Tensor) -> torch.Tensor:
            return self.tok(idx) @ self.tok.weight.t()  # the output head reads the table

    gm = torch.fx.symbolic_trace(Tied())
    assert backward_free_units([gm]) == frozenset()
    assert backward_free_units([torch.fx.symbolic_trace(nn.Embedding(4, 2, max_norm=1.0))]) == set()
