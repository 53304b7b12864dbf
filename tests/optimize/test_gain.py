"""The rehearsal of a job's trainers together (``Lockstep``): two real gloo ranks, one slower."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch
import torch.fx
from torch import nn

from distopt.dist import rendezvous
from distopt.estimate.step import predict_step
from distopt.optimize.gain import Lockstep, rehearse

_SLOW_S = 0.02
"""Rank 1's forward sleeps this long, rank 0's not at all."""


@torch.fx.wrap
def _pause(x: torch.Tensor, seconds: float) -> torch.Tensor:
    time.sleep(seconds)
    return x


class _Model(nn.Module):
    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds = seconds
        self.linear = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(_pause(x, self.seconds))


def _rehearse_in_step(rank: int, out: str) -> None:
    torch.manual_seed(0)
    model = _Model(_SLOW_S if rank == 1 else 0.0)
    lockstep = Lockstep(gradient_bytes=1 << 20)
    costs = rehearse(
        model,
        torch.fx.symbolic_trace(model),
        (torch.randn(4, 8),),
        pushes="in_turn",
        steps=3,
        read_latency_s=0.0,
        lockstep=lockstep,
    )
    step = predict_step(costs)
    Path(out, f"rank{rank}.json").write_text(
        json.dumps(
            {
                "rehearsed": costs.rehearsed,
                "trainers": costs.trainers,
                "all_reduce_bytes": costs.all_reduce_bytes,
                "step_s": step.baseline_s,
                "how": step.assumptions["all_reduce"],
            }
        )
    )


@pytest.mark.slow
def test_trainers_rehearse_in_step_and_the_fast_one_waits_in_the_all_reduce(
    tmp_path: Path,
) -> None:
    """Issue 24: a job's trainers rehearse as they train. Every chunk runs on both (no hang
    when one is slower), the fast trainer's all-reduce holds its wait for the slow one, and both
    predict the step of the slower."""
    rendezvous.run_spawned(
        _rehearse_in_step, str(tmp_path), world_size=2, what="lockstep rehearsal", timeout_s=60.0
    )
    fast, slow = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    for rank in (fast, slow):
        assert rank["trainers"] == 2 and rank["all_reduce_bytes"] == 1 << 20
        assert "1,048,576 dense gradient bytes" in rank["how"]
        assert rank["step_s"] >= _SLOW_S * 0.9, rank
    baseline = fast["rehearsed"]["baseline"]
    assert baseline["all_reduce"] >= _SLOW_S * 0.5, baseline  # waited for rank 1's forward
    assert baseline["backward"] >= baseline["all_reduce"]  # the all-reduce is part of backward
    assert slow["rehearsed"]["baseline"]["forward"] >= _SLOW_S * 0.9
    assert slow["rehearsed"]["baseline"]["all_reduce"] < baseline["all_reduce"]
