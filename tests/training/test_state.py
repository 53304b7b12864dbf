"""A trainer's checkpoint in one process: dense state through DCP, RNG states, remote hooks."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from torch import nn

from distopt.errors import ConfigError
from distopt.training import checkpoint
from distopt.training.state import (
    TrainerState,
    cut,
    find,
    read_tensors,
    restore,
    set_rng_state,
    trainer_state,
)

JOB = {"run_id": "r", "num_trainers": 1, "num_ps": 0, "parallel": "none"}


def _trainer(seed: int) -> TrainerState:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(5, 3)).sum().backward()
    optimizer.step()  # momentum buffers exist
    return trainer_state(
        model=model, optimizer=optimizer, rank=0, parallel="none", num_trainers=1, job=JOB
    )


def test_cut_then_restore_brings_back_dense_state_rng_and_remote(tmp_path: Path) -> None:
    saved = _trainer(0)
    remote: list[str] = []
    random.seed(7)
    torch.manual_seed(7)
    done = cut(
        tmp_path, saved, step=3, before=lambda: remote.append("drain"),
        save_remote=lambda p: torch.save({"tables": {"t": {"weight": torch.ones(2)}}}, p / "ps0.pt"),
    )  # fmt: skip
    assert done is not None and done.step == 3 and "ps0.pt" in done.manifest["files"]
    expected = (torch.rand(3), random.random())  # what the next step would draw

    fresh = _trainer(1)  # other parameters and momentum
    found = find(tmp_path, rank=fresh.rank, job=fresh.job)
    assert found is not None and found.path == done.path
    rank_file = restore(found, fresh, load_remote=lambda p: remote.append(p.name))
    assert remote == ["drain", "step-00000003"]
    for a, b in zip(saved.model.parameters(), fresh.model.parameters(), strict=True):
        assert torch.equal(a, b)
    for a, b in zip(saved.model.parameters(), fresh.model.parameters(), strict=True):
        momentum = (
            saved.optimizer.state[a]["momentum_buffer"],
            fresh.optimizer.state[b]["momentum_buffer"],
        )
        assert torch.equal(*momentum)
    set_rng_state(rank_file["rng"])
    assert torch.equal(torch.rand(3), expected[0]) and random.random() == expected[1]
    tensors = read_tensors(found)
    assert torch.equal(tensors["dense/model/0.weight"], saved.model[0].weight)
    assert torch.equal(tensors["ps0/t/weight"], torch.ones(2))


def test_resume_refuses_a_checkpoint_of_another_job_shape(tmp_path: Path) -> None:
    cut(tmp_path, _trainer(0), step=2)
    other = _trainer(0)
    other = trainer_state(
        model=other.model, optimizer=other.optimizer, rank=0, parallel="none", num_trainers=1,
        job={**JOB, "num_ps": 2},
    )  # fmt: skip
    with pytest.raises(ConfigError, match="written with num_ps=0, this job has num_ps=2"):
        find(tmp_path, rank=other.rank, job=other.job)


def test_find_skips_an_incomplete_newer_checkpoint(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    state = _trainer(0)
    cut(tmp_path, state, step=2)
    partial = checkpoint.begin(tmp_path, 4)
    (partial / "rank0.pt").write_bytes(b"half")
    found = find(tmp_path, rank=state.rank, job=state.job)
    assert found is not None and found.step == 2
    assert f"ignoring incomplete checkpoint {partial}: no MANIFEST.json" in caplog.text
