"""distopt.parallelize: training on the distopt partition matches plain DDP/FSDP2/FSDP1 (2 gloo ranks)."""

from __future__ import annotations

import copy
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import distopt
from distopt.dist.rendezvous import StorePlan, init_gloo, spawned_gloo
from distopt.errors import ConfigError
from distopt.models import build, make_inputs
from distopt.parallel import ParallelizeConfig, timing_of

STEPS = 20
RTOL, ATOL = 1e-4, 1e-5
"""Both runs do the same float32 math per element; only summation order inside the collectives
may differ, so 20 SGD steps agree to ~1e-6. The tolerance leaves an order of magnitude."""


def _gpt(*, tied: bool = False) -> nn.Module:
    torch.manual_seed(0)
    model = build("gpt", vocab_size=64, dim=32, heads=2, layers=3, seq_len=16, dropout=0.0)
    if tied:  # the usual language model: the head shares the token embedding's weight
        model.head.weight = model.tok.weight
    return model


def _reference(strategy: str, model: nn.Module) -> nn.Module:
    if strategy == "fsdp":
        from torch.distributed.fsdp import fully_shard

        return fully_shard(model)
    if strategy == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel

        return FullyShardedDataParallel(model, use_orig_params=True, device_id=torch.device("cpu"))
    return nn.parallel.DistributedDataParallel(model)


def _full(value: torch.Tensor) -> torch.Tensor:
    return value.full_tensor() if hasattr(value, "full_tensor") else value


def _train(model: nn.Module, rank: int) -> list[float]:
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    losses = []
    for step in range(STEPS):
        gen = torch.Generator().manual_seed(1000 * rank + step)
        idx = torch.randint(0, 64, (4, 16), generator=gen)
        target = torch.randint(0, 64, (4, 16), generator=gen)
        loss = nn.functional.cross_entropy(model(idx).flatten(0, 1), target.flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        reduced = loss.detach().clone()
        dist.all_reduce(reduced)
        losses.append(float(reduced) / dist.get_world_size())
    return losses


def _worker(
    rank: int,
    world: int,
    plan: StorePlan,
    strategy: str,
    cache_dir: str,
    memory_slack: float,
    num_units: int | None,
    tied: bool,
) -> None:
    torch.set_num_threads(1)  # two ranks share two cores: more threads only oversubscribe
    init_gloo(plan, me=f"rank{rank}", rank=rank, world_size=world, timeout_s=60.0)
    try:
        original = _gpt(tied=tied)
        keys = list(original.state_dict().keys())
        ours_model = copy.deepcopy(original)
        example = make_inputs("gpt", original, 2)
        ref = _reference(strategy, original)
        ours = distopt.parallelize(
            ours_model,
            strategy,
            example_inputs=example,
            num_units=num_units,
            min_unit_bytes=4096,
            cache_dir=cache_dir,
            memory_slack=memory_slack,
        )
        if strategy != "ddp" and not tied:
            assert timing_of(ours) is not None and timing_of(ours).units >= 2, timing_of(ours)
        with pytest.raises(ConfigError, match=r"already wrapped by distopt.parallelize \("):
            distopt.parallelize(ours, strategy, example_inputs=example)
        with pytest.raises(ConfigError, match=r"already given to distopt.parallelize"):
            distopt.parallelize(ours_model, strategy, example_inputs=example)
        if strategy == "fsdp" and memory_slack > 1:
            # Unbounded memory: every unit is gathered once per step (held by the root or kept
            # from forward into backward), so training runs on the no-reshard path throughout.
            schedule = timing_of(ours).schedule
            assert len(schedule.root_held | schedule.keep_after_forward) == timing_of(ours).units, (
                schedule
            )
        if strategy == "fsdp" and num_units is None and not tied:
            # One unit per block: the embeddings are a unit of their own, which backward does not
            # gather (embedding gradients need the indices only); training must not notice.
            assert timing_of(ours).schedule.backward_free == {0}, timing_of(ours).schedule
        ref_losses, our_losses = _train(ref, rank), _train(ours, rank)
        torch.testing.assert_close(our_losses, ref_losses, rtol=RTOL, atol=ATOL)
        # Plain DDP prefixes its keys with ``module.``; ours are the model's for every strategy.
        ref_state = {k.removeprefix("module."): v for k, v in ref.state_dict().items()}
        our_state = ours.state_dict()
        assert list(our_state) == keys, list(our_state)[:5]
        for key, value in our_state.items():
            torch.testing.assert_close(
                _full(value), _full(ref_state[key]), rtol=RTOL, atol=ATOL, msg=key
            )
        # Round trip: the reference's checkpoint loads into the parallelized model under the same keys.
        ours.load_state_dict(ref_state)
        for key, value in ours.state_dict().items():
            torch.testing.assert_close(_full(value), _full(ref_state[key]), rtol=0, atol=0, msg=key)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize(
    ("strategy", "memory_slack", "num_units", "tied"),
    [
        ("fsdp", 0.2, 3, False),
        ("fsdp", 100.0, 3, False),
        ("fsdp", 0.2, None, False),
        # Tied head and embedding: one tensor under two keys, both kept in the state dict.
        ("fsdp", 0.2, None, True),
        ("fsdp1", 0.2, 3, False),
        ("ddp", 0.2, 3, False),
    ],
)
def test_training_matches_plain_wrapper(
    strategy: str, memory_slack: float, num_units: int | None, tied: bool, tmp_path
) -> None:
    with spawned_gloo() as plan:
        mp.spawn(
            _worker,
            args=(2, plan, strategy, str(tmp_path), memory_slack, num_units, tied),
            nprocs=2,
            join=True,
        )


def test_config_rejects_unknown_strategy() -> None:
    with pytest.raises(ConfigError, match="strategy.*'zero3'"):
        ParallelizeConfig(strategy="zero3")  # type: ignore[arg-type]


def test_config_rejects_unknown_compile_backend() -> None:
    with pytest.raises(ConfigError, match=r"compile_backend: unknown .* 'nonexistent' \(known: "):
        ParallelizeConfig(compile=True, compile_backend="nonexistent")


def test_parallelize_is_exported() -> None:
    assert "parallelize" in distopt.__all__ and distopt.parallelize is not None
    assert os.path.basename(distopt.parallel.__file__) == "__init__.py"
