"""Held-out evaluation (distopt.training.evaluate), alone and all-reduced over 2 gloo ranks."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.utils.data import Dataset

from distopt.config import from_dict
from distopt.data.batch import Batch
from distopt.data.loader import build_eval_loader
from distopt.dist.rendezvous import StorePlan, init_gloo, spawned_gloo
from distopt.errors import ConfigError
from distopt.training.evaluate import EvalConfig, auc, evaluate


class Clicks(Dataset):
    """Fixed scores as the model input; labels loosely follow them (ties included)."""

    def __init__(self, n: int = 101) -> None:
        gen = torch.Generator().manual_seed(3)
        self.x = torch.randint(0, 8, (n, 1), generator=gen).float() / 4 - 1
        self.y = (torch.rand(n, 1, generator=gen) < torch.sigmoid(3 * self.x)).float()

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        return self.x[i], self.y[i]


def collate(samples) -> Batch:
    return Batch((torch.stack([s[0] for s in samples]),), torch.stack([s[1] for s in samples]))


class Identity(nn.Module):
    """Logit = input; records the mode and grad mode it ran in."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(()))
        self.frozen = nn.Dropout()
        self.seen: list[tuple[bool, bool]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append((self.training, torch.is_grad_enabled()))
        return x * self.scale


def mann_whitney(scores: torch.Tensor, labels: torch.Tensor) -> float:
    pos, neg = scores[labels == 1], scores[labels == 0]
    wins = (pos[:, None] > neg[None, :]).double() + 0.5 * (pos[:, None] == neg[None, :]).double()
    return float(wins.mean())


def test_auc_counts_ties_half_and_is_nan_for_one_class() -> None:
    data = Clicks()
    assert auc(torch.sigmoid(data.x.flatten()), data.y.flatten()) == pytest.approx(
        mann_whitney(data.x.flatten(), data.y.flatten()), abs=1e-12
    )
    assert math.isnan(auc(torch.tensor([0.1, 0.2]), torch.tensor([1.0, 1.0])))


def test_click_metrics_in_eval_mode_without_grad_and_mode_restored() -> None:
    model, data = Identity(), Clicks()
    model.frozen.eval()  # a submodule deliberately in eval mode stays so
    result = evaluate(
        model, build_eval_loader(data, batch_size=16, collate_fn=collate), task="click"
    )
    expected_loss = nn.functional.binary_cross_entropy_with_logits(data.x, data.y)
    assert result.samples == 101 and result.loss == pytest.approx(float(expected_loss), rel=1e-6)
    assert result.auc == pytest.approx(mann_whitney(data.x.flatten(), data.y.flatten()), abs=1e-12)
    assert set(model.seen) == {(False, False)}
    assert model.training and not model.frozen.training
    assert result.as_dict() == {
        "eval_loss": result.loss,
        "eval_samples": 101,
        "eval_auc": result.auc,
    }


def test_token_and_plain_metrics() -> None:
    logits = torch.randn(3, 5, 7)
    targets = torch.randint(0, 7, (3, 5))

    class Fixed(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return logits[x]

    batches = [
        Batch((torch.tensor([0, 1]),), targets[:2]),
        Batch((torch.tensor([2]),), targets[2:]),
    ]
    result = evaluate(Fixed(), batches, task="tokens")
    expected = nn.functional.cross_entropy(logits.reshape(-1, 7), targets.reshape(-1))
    assert result.samples == 15 and result.loss == pytest.approx(float(expected), rel=1e-6)
    assert result.perplexity == pytest.approx(math.exp(float(expected)), rel=1e-6)
    plain = evaluate(
        nn.Linear(2, 1), [(torch.ones(4, 2),), (torch.ones(2, 2),)], task="none", max_batches=1
    )
    assert plain.samples == 4 and plain.auc is None and plain.perplexity is None
    with pytest.raises(ConfigError, match="^data.task: click evaluation needs targets"):
        evaluate(nn.Linear(2, 1), [(torch.ones(4, 2),)], task="click")


def test_eval_config() -> None:
    cfg = EvalConfig(every=5)
    assert [s for s in range(1, 13) if cfg.due(s, 12)] == [5, 10, 12]
    with pytest.raises(ConfigError, match=r"^eval.every: expected an integer >= 0, got -1$"):
        from_dict(EvalConfig, {"every": -1}, prefix="eval")


def _rank(rank: int, world_size: int, plan: StorePlan, out: str) -> None:
    init_gloo(plan, me=f"rank{rank}", rank=rank, world_size=world_size, timeout_s=60.0)
    try:
        # 101 samples over 2 ranks: 51 and 50, no padding; batch 8 leaves uneven last batches.
        loader = build_eval_loader(
            Clicks(), rank=rank, world_size=world_size, batch_size=8, collate_fn=collate
        )
        result = evaluate(Identity(), loader, task="click")
        torch.save(result.as_dict(), Path(out) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_all_reduced_metrics_equal_the_metrics_of_the_union(tmp_path: Path) -> None:
    with spawned_gloo() as plan:
        mp.spawn(_rank, args=(2, plan, str(tmp_path)), nprocs=2, join=True)
    results = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    assert results[0] == results[1]  # every rank gets the union's metrics
    whole = evaluate(
        Identity(), build_eval_loader(Clicks(), batch_size=101, collate_fn=collate), task="click"
    )
    assert results[0]["eval_samples"] == 101
    assert results[0]["eval_auc"] == pytest.approx(whole.auc, abs=1e-12)
    assert results[0]["eval_loss"] == pytest.approx(
        whole.loss, rel=1e-6
    )  # float32 sums in another order


def _lockstep_rank(rank: int, world_size: int, plan: StorePlan, out: str) -> None:
    from torch.distributed.fsdp import fully_shard

    init_gloo(plan, me=f"rank{rank}", rank=rank, world_size=world_size, timeout_s=60.0)
    try:
        model = nn.Linear(1, 1)
        with torch.no_grad():
            model.weight.fill_(1.0)
            model.bias.zero_()
        fully_shard(model)  # every forward all-gathers: ranks must run as many forwards
        # 51 and 50 samples in batches of 2: 26 and 25 batches.
        loader = build_eval_loader(
            Clicks(), rank=rank, world_size=world_size, batch_size=2, collate_fn=collate
        )
        result = evaluate(model, loader, task="click", lockstep=True)
        torch.save(result.as_dict(), Path(out) / f"lockstep{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_lockstep_evaluates_a_collective_model_on_uneven_shards(tmp_path: Path) -> None:
    with spawned_gloo() as plan:
        mp.spawn(_lockstep_rank, args=(2, plan, str(tmp_path)), nprocs=2, join=True)
    results = [torch.load(tmp_path / f"lockstep{r}.pt") for r in range(2)]
    whole = evaluate(
        Identity(), build_eval_loader(Clicks(), batch_size=101, collate_fn=collate), task="click"
    )
    assert results[0] == results[1] and results[0]["eval_samples"] == 101  # repeats not counted
    assert results[0]["eval_auc"] == pytest.approx(whole.auc, abs=1e-12)
