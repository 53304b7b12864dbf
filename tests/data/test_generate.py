"""Learnable test data (distopt.data.generate), trained end to end through the data pipeline:
config → build_data → loaders → Stepper → evaluate."""

from __future__ import annotations

import hashlib
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from distopt import models
from distopt.data import DataConfig, build_data
from distopt.data.generate import chain_entropy, unigram_entropy, write_criteo, write_tokens
from distopt.models.dlrm import DLRM, DLRMConfig
from distopt.training.evaluate import evaluate
from distopt.training.optim import OptimConfig, ScheduleConfig, Stepper


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_generators_are_deterministic(tmp_path: Path) -> None:
    a = write_criteo(tmp_path / "a.tsv", num_samples=300, seed=4)
    b = write_criteo(tmp_path / "b.tsv", num_samples=300, seed=4)
    c = write_criteo(tmp_path / "c.tsv", num_samples=300, seed=5)
    assert _digest(a) == _digest(b) != _digest(c)
    lines = a.read_text().splitlines()
    assert len(lines) == 300 and all(len(line.split("\t")) == 40 for line in lines)
    assert any("\t\t" in line for line in lines)  # missing values occur
    t1 = write_tokens(tmp_path / "a.bin", num_tokens=1000, seed=1)
    t2 = write_tokens(tmp_path / "b.bin", num_tokens=1000, seed=1)
    assert _digest(t1) == _digest(t2) and t1.stat().st_size == 2000


def test_unigram_entropy(tmp_path: Path) -> None:
    path = tmp_path / "u.bin"
    np.array([0, 1, 2, 3] * 10, dtype=np.uint16).tofile(path)
    assert unigram_entropy(path) == pytest.approx(math.log(4))
    np.array([7] * 10, dtype=np.uint32).tofile(path)
    assert unigram_entropy(path, dtype="uint32") == 0.0


class LocalDLRM(DLRM):
    """The DLRM reference model with its tables held locally (no parameter servers in a unit test):
    same bottom MLP, towers, interaction and ``forward(dense, sparse)`` input layout."""

    def __init__(self, config: DLRMConfig) -> None:
        super().__init__(config)
        self.embeddings = nn.ModuleList(
            nn.Embedding(config.num_rows, config.embedding_dim) for _ in range(config.num_tables)
        )
        for table in self.embeddings:
            nn.init.normal_(table.weight, std=0.05)

    def forward(self, dense: torch.Tensor, sparse: torch.Tensor) -> torch.Tensor:
        h = self.bottom(dense)
        features = [
            tower(h) + self.embeddings[k](sparse[k]).sum(dim=1)
            for k, tower in enumerate(self.towers)
        ]
        return self.interact(h, features)


def test_dlrm_learns_the_click_log_to_a_high_held_out_auc(tmp_path: Path) -> None:
    path = write_criteo(tmp_path / "clicks.tsv", num_samples=12_000, seed=0)
    model = LocalDLRM(DLRMConfig(num_tables=4, num_rows=2000, bag_size=7, embedding_dim=8))
    data = build_data(
        DataConfig(source="criteo", path=str(path), holdout_fraction=0.25),
        model_name="dlrm",
        model=model,
        batch_size=128,
        seed=0,
    )
    assert data.task == "click" and len(data.eval) == 3000
    steps = 100  # under one epoch: enough, and no time to overfit the noise features
    stepper = Stepper(model.parameters(), OptimConfig(name="adam", lr=0.003), total_steps=steps)
    held = data.eval_loader(rank=0, world_size=1, batch_size=500)
    before = evaluate(model, held, task="click")
    for step, batch in zip(
        range(steps),
        data.train_loader(rank=0, world_size=1, batch_size=128, seed=0).batches(),
        strict=False,
    ):
        loss = nn.functional.binary_cross_entropy_with_logits(model(*batch.inputs), batch.targets)
        stepper.scale(loss).backward()
        stepper.step(step)
    after = evaluate(model, held, task="click")
    assert after.samples == 3000
    # The best achievable AUC (scoring by the true click probability) is 0.89 for this file.
    assert before.auc < 0.65 < 0.78 < after.auc, (before, after)
    assert after.loss < before.loss


def test_gpt_learns_the_token_file_below_its_unigram_entropy(tmp_path: Path) -> None:
    path = write_tokens(tmp_path / "tokens.bin", num_tokens=30_000, vocab_size=64, seed=0)
    unigram = unigram_entropy(path)
    assert chain_entropy(64, 4, 0) < 1.5 < unigram
    torch.manual_seed(0)
    model = models.build("gpt", vocab_size=64, dim=32, heads=2, layers=1, seq_len=32, dropout=0.0)
    data = build_data(
        DataConfig(source="tokens", path=str(path), holdout_fraction=0.1),
        model_name="gpt",
        model=model,
        batch_size=16,
        seed=0,
    )
    steps = 80
    stepper = Stepper(
        model.parameters(),
        OptimConfig(
            name="adamw", lr=1e-2, schedule=ScheduleConfig(warmup_steps=10, decay="cosine")
        ),
        total_steps=steps,
    )
    loader = data.train_loader(rank=0, world_size=1, batch_size=16, seed=0)
    for step, batch in zip(range(steps), loader.batches(), strict=False):
        logits = model(*batch.inputs)
        loss = nn.functional.cross_entropy(logits.reshape(-1, 64), batch.targets.reshape(-1))
        stepper.scale(loss).backward()
        stepper.step(step)
    result = evaluate(model, data.eval_loader(rank=0, world_size=1, batch_size=64), task="tokens")
    assert result.samples == (3000 - 1) // 32 * 32
    assert result.loss < unigram - 1.5, (result, unigram)  # 3.8 nats → about 1.3
    assert result.perplexity == pytest.approx(math.exp(result.loss))


def test_command_line(tmp_path: Path, capsys) -> None:
    from distopt.data.generate import main

    assert main(["tokens", str(tmp_path / "t.bin"), "--samples", "500", "--vocab-size", "16"]) == 0
    assert (
        "unigram entropy" in capsys.readouterr().out and (tmp_path / "t.bin").stat().st_size == 1000
    )
    assert main(["criteo", str(tmp_path / "c.tsv"), "--samples", "20"]) == 0
    assert len((tmp_path / "c.tsv").read_text().splitlines()) == 20
