"""Checkpoints: atomic write, newest found, state restored."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from distopt.errors import ConfigError
from distopt.job.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint


def _model_and_optimizer() -> tuple[nn.Module, torch.optim.Optimizer]:
    model = nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(4, 3)).sum().backward()
    optimizer.step()  # momentum buffers exist
    return model, optimizer


def test_save_then_load_restores_model_and_optimizer(tmp_path: Path) -> None:
    model, optimizer = _model_and_optimizer()
    path = save_checkpoint(
        tmp_path, step=7, model=model, optimizer=optimizer, extra={"run_id": "r"}
    )
    assert path.name == "step-00000007.pt"
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temporary file left
    fresh = nn.Linear(3, 2)
    fresh_opt = torch.optim.SGD(fresh.parameters(), lr=0.1, momentum=0.9)
    state = load_checkpoint(path, model=fresh, optimizer=fresh_opt)
    assert state["step"] == 7 and state["run_id"] == "r"
    for a, b in zip(model.parameters(), fresh.parameters(), strict=True):
        assert torch.equal(a, b)
    momentum = [s["momentum_buffer"] for s in fresh_opt.state_dict()["state"].values()]
    assert len(momentum) == 2


def test_latest_checkpoint_ignores_partial_files(tmp_path: Path) -> None:
    model, optimizer = _model_and_optimizer()
    assert latest_checkpoint(tmp_path / "none") is None
    save_checkpoint(tmp_path, step=5, model=model, optimizer=optimizer)
    save_checkpoint(tmp_path, step=12, model=model, optimizer=optimizer)
    (tmp_path / ".step-00000020.pt.abc.tmp").write_bytes(b"partial")  # an interrupted save
    assert latest_checkpoint(tmp_path) == tmp_path / "step-00000012.pt"


def test_corrupt_checkpoint_is_a_one_line_error(tmp_path: Path) -> None:
    model, optimizer = _model_and_optimizer()
    bad = tmp_path / "step-00000001.pt"
    bad.write_bytes(b"not a checkpoint")
    with pytest.raises(ConfigError, match=f"checkpoint {bad}: cannot load"):
        load_checkpoint(bad, model=model, optimizer=optimizer)
