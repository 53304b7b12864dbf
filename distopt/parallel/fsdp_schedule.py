"""Which FSDP2 units stay gathered longer: trade a bounded amount of memory for fewer all-gathers.

Every FSDP2 unit is all-gathered for its forward and, after being freed, again for its backward.
Three kinds of units can skip a gather:

* units left to the **root**: the root's parameters are gathered once per step and kept, so a
  small unit at the edges of the model (embeddings, final norm, output head) costs one gather
  instead of two — but it is held for the whole step;
* the **tail**: the last units of forward are the first of backward. Not resharding them after
  forward saves their second gather; they are held only across the turn from forward to backward;
* **backward-free** units, whose backward reads none of their parameters (embedding lookups: the
  gradient of an embedding table needs the indices, not the table). FSDP2 would gather them again
  for nothing; ``set_unshard_in_backward(False)`` skips that gather at no memory cost, so they
  count once, like kept units.

The cost is all-gathered bytes because the step time follows them where it was measured
(fsdp_partition, 2 gloo ranks on CPU, docs/benchmarks.md): FSDP2's collectives block there (no
streams to hide them behind compute), so every gathered byte is on the critical path; keeping 4
units rather than 2 measured faster, as the model says. Before backward-free units were counted,
the plan gathered the embeddings twice where the per-block policy (root holds them) gathers them
once, and matched that policy's step time instead of beating it.

The planner enumerates those choices on the units' parameter bytes and picks the one with the
fewest gathered bytes whose per-rank parameter memory (shards + everything held unsharded at the
peak) stays within ``1 + memory_slack`` of the leanest schedule (nothing held, only the last unit
kept). For a 14-block GPT this reproduces the expert's choice (blocks as units) and then keeps
the last blocks across the turn::

    unit bytes (MiB)   [24, 27 × 14, 24]           (embeddings, blocks, norm + head)
    leanest            gathers 804 MiB/step, param memory 267 MiB  (embeddings gathered once)
    chosen (slack 0.2) tail = last 4 units: gathers 723 MiB/step, param memory 318 MiB
    per-block policy   root holds embeddings and head: gathers 777 MiB/step, 326 MiB
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Sequence


@dataclasses.dataclass(frozen=True, slots=True)
class FsdpSchedule:
    root_held: frozenset[int]
    """Unit indices left to the root (not sharded as units of their own)."""
    keep_after_forward: frozenset[int]
    """Unit indices not resharded after forward."""
    backward_free: frozenset[int]
    """Sharded unit indices not all-gathered in backward (their backward reads no parameter)."""
    gathered_bytes: int
    """All-gathered parameter bytes per step (unsharded sizes)."""
    memory_bytes: int
    """Per-rank parameter memory at the peak: shards plus what is unsharded at once."""


def peak_param_bytes(
    total: int, root: int, units: Sequence[int], kept: Sequence[bool], world_size: int
) -> int:
    """Per-rank parameter memory at its peak: the shards, the unsharded root, and the larger of
    two consecutive units (forward and backward prefetch both hold a unit and the next one) and
    the units kept from forward into backward (all held at the turn).

    ``units`` are the sharded units' bytes in execution order; ``kept[i]`` says unit i is kept.
    """
    pair = max(
        (a + b for a, b in zip(units, units[1:], strict=False)), default=max(units, default=0)
    )
    held = sum(b for b, k in zip(units, kept, strict=True) if k)
    return total // world_size + root + max(pair, held)


def _evaluate(
    sizes: Sequence[int],
    held: tuple[int, ...],
    tail: int,
    world_size: int,
    backward_free: Collection[int] = (),
) -> FsdpSchedule:
    sharded = [i for i in range(len(sizes)) if i not in held]
    kept = sharded[len(sharded) - tail :] if tail else []
    once = set(kept) | set(backward_free)
    held_bytes = sum(sizes[i] for i in held)
    gathered = held_bytes + sum(sizes[i] * (1 if i in once else 2) for i in sharded)
    return FsdpSchedule(
        root_held=frozenset(held),
        keep_after_forward=frozenset(kept),
        backward_free=frozenset(i for i in sharded if i in backward_free),
        gathered_bytes=gathered,
        memory_bytes=peak_param_bytes(
            sum(sizes),
            held_bytes,
            [sizes[i] for i in sharded],
            [i in kept for i in sharded],
            world_size,
        ),
    )


def leanest_schedule(
    unit_bytes: Sequence[int], *, world_size: int, backward_free: Collection[int] = ()
) -> FsdpSchedule:
    """Every unit sharded, only the last one kept from forward into backward."""
    return _evaluate(unit_bytes, (), 1 if unit_bytes else 0, world_size, backward_free)


def plan_fsdp_schedule(
    unit_bytes: Sequence[int],
    *,
    world_size: int,
    memory_slack: float = 0.2,
    backward_free: Collection[int] = (),
) -> FsdpSchedule:
    """The schedule with the fewest gathered bytes within ``(1 + memory_slack)`` × the leanest memory.

    ``unit_bytes`` are the units' parameter bytes in execution order; ``backward_free`` the units
    whose backward reads none of their parameters (gathered once when sharded).
    """
    n = len(unit_bytes)
    if n == 0:
        return FsdpSchedule(frozenset(), frozenset(), frozenset(), 0, 0)
    leanest = leanest_schedule(unit_bytes, world_size=world_size, backward_free=backward_free)
    limit = leanest.memory_bytes * (1.0 + memory_slack)
    edges: list[tuple[int, ...]] = [()]
    if n > 2:
        edges += [(0,), (n - 1,), (0, n - 1)]
    best = leanest
    for held in edges:
        for tail in range(1, n - len(held) + 1):
            candidate = _evaluate(unit_bytes, held, tail, world_size, backward_free)
            if candidate.memory_bytes > limit:
                continue
            if (candidate.gathered_bytes, candidate.memory_bytes) < (
                best.gathered_bytes,
                best.memory_bytes,
            ):
                best = candidate
    return best
