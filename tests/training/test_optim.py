"""Dense optimizer configs, schedules and their checkpoints (distopt.training.optim)."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from distopt.config import from_dict
from distopt.errors import ConfigError
from distopt.training.optim import (
    OptimConfig,
    ScheduleConfig,
    Stepper,
    build_optimizer,
    build_scheduler,
)


@pytest.mark.parametrize(
    ("name", "cls"),
    [
        ("sgd", torch.optim.SGD),
        ("Adam", torch.optim.Adam),
        ("adamw", torch.optim.AdamW),
        ("adagrad", torch.optim.Adagrad),
    ],
)
def test_optimizer_by_name(name: str, cls: type) -> None:
    opt = build_optimizer(nn.Linear(2, 2).parameters(), OptimConfig(name=name, lr=0.1))
    assert type(opt) is cls and opt.param_groups[0]["lr"] == 0.1


def test_kwargs_reach_the_optimizer_and_lists_become_tuples() -> None:
    cfg = from_dict(
        OptimConfig,
        {"name": "adamw", "lr": 3e-4, "kwargs": {"betas": [0.9, 0.95], "weight_decay": 0.1}},
        prefix="optim",
    )
    group = build_optimizer(nn.Linear(2, 2).parameters(), cfg).param_groups[0]
    assert group["betas"] == (0.9, 0.95) and group["weight_decay"] == 0.1


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"name": "adamw2"}, r"^optim.name: unknown optimizer 'adamw2' \(known: .*adamw, .*sgd"),
        (
            {"name": "adam", "kwargs": {"betas2": 1}},
            r"^optim.kwargs.betas2: Adam takes no argument 'betas2' \(accepted: betas, eps, weight_decay",
        ),
        (
            {"name": "sgd", "kwargs": {"betas": [0.9, 0.9]}},
            r"^optim.kwargs.betas: SGD takes no argument",
        ),
        (
            {"name": "adam", "kwargs": {"betas": [1.5, 0.9]}},
            r"^optim.kwargs: Adam rejects .*Invalid beta parameter at index 0",
        ),
        ({"lr": 0}, r"^optim.lr: expected a number > 0, got 0"),
        ({"clip_grad_norm": -1.0}, r"^optim.clip_grad_norm: expected a number > 0, got -1.0"),
        ({"accumulate_steps": 0}, r"^optim.accumulate_steps: expected an integer >= 1, got 0"),
        ({"schedule": {"decay": "step"}}, r"^optim.schedule.decay: expected one of"),
        (
            {"schedule": {"min_lr_factor": 2}},
            r"^optim.schedule.min_lr_factor: expected a number in \[0, 1\]",
        ),
    ],
)
def test_bad_config_is_one_line_naming_the_key(data: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message) as info:
        from_dict(OptimConfig, data, prefix="optim")
    assert "\n" not in str(info.value)


def _lrs(cfg: OptimConfig, total: int) -> list[float]:
    opt = build_optimizer([torch.zeros(1, requires_grad=True)], cfg)
    sched = build_scheduler(opt, cfg, total)
    lrs = []
    for _ in range(total):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return lrs


def test_warmup_then_cosine_decay() -> None:
    cfg = OptimConfig(
        lr=1.0, schedule=ScheduleConfig(warmup_steps=4, decay="cosine", min_lr_factor=0.1)
    )
    lrs = _lrs(cfg, 14)
    assert lrs[:4] == pytest.approx([0.25, 0.5, 0.75, 1.0])
    assert lrs[4] == pytest.approx(1.0)
    assert lrs[9] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert all(a >= b for a, b in zip(lrs[3:], lrs[4:], strict=False))
    assert lrs[-1] > 0.1 and _lrs(cfg, 20)[-1] == pytest.approx(0.1, abs=0.02)


def test_linear_decay_and_constant() -> None:
    linear = _lrs(OptimConfig(lr=2.0, schedule=ScheduleConfig(decay="linear")), 5)
    assert linear == pytest.approx([2.0, 1.6, 1.2, 0.8, 0.4])
    assert _lrs(OptimConfig(lr=0.5), 3) == [0.5, 0.5, 0.5]
    held = _lrs(OptimConfig(lr=1.0, schedule=ScheduleConfig(decay="linear", decay_steps=2)), 5)
    assert held == pytest.approx([1.0, 0.5, 0.0, 0.0, 0.0])


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))


def _micro_batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    return [(torch.randn(6, 4, generator=gen), torch.randn(6, 1, generator=gen)) for _ in range(n)]


def _train(model: nn.Module, stepper: Stepper, batches, first: int = 0) -> list[float]:
    lrs = []
    for i, (x, y) in enumerate(batches, start=first):
        stepper.scale(nn.functional.mse_loss(model(x), y)).backward()
        if stepper.step(i):
            lrs.append(stepper.lr)
    return lrs


@pytest.mark.parametrize("name", ["adamw", "adagrad", "sgd"])
def test_resume_mid_schedule_matches_an_uninterrupted_run(name: str) -> None:
    kwargs = {"momentum": 0.9} if name == "sgd" else {}
    cfg = OptimConfig(
        name=name,
        lr=0.05,
        kwargs=kwargs,
        clip_grad_norm=0.5,
        accumulate_steps=2,
        schedule=ScheduleConfig(warmup_steps=3, decay="cosine"),
    )
    batches = _micro_batches(20)
    whole = _model()
    whole_stepper = Stepper(whole.parameters(), cfg, total_steps=10)
    whole_lrs = _train(whole, whole_stepper, batches)

    first = _model()
    first_stepper = Stepper(first.parameters(), cfg, total_steps=10)
    lrs = _train(first, first_stepper, batches[:8])
    saved_model, saved_optim = first.state_dict(), first_stepper.state_dict()
    resumed = _model()
    resumed.load_state_dict(saved_model)
    resumed_stepper = Stepper(resumed.parameters(), cfg, total_steps=10)
    resumed_stepper.load_state_dict(saved_optim)
    lrs += _train(resumed, resumed_stepper, batches[8:], first=8)

    assert lrs == whole_lrs and len(lrs) == 10
    for a, b in zip(resumed.parameters(), whole.parameters(), strict=True):
        assert torch.equal(a, b)
    for a, b in zip(
        resumed_stepper.optimizer.state.values(),
        whole_stepper.optimizer.state.values(),
        strict=True,
    ):
        for key in a:
            assert torch.equal(torch.as_tensor(a[key]), torch.as_tensor(b[key])), key


def test_accumulation_equals_one_big_batch() -> None:
    x, y = torch.randn(8, 4), torch.randn(8, 1)
    big, small = _model(), _model()
    big_stepper = Stepper(big.parameters(), OptimConfig(lr=0.1), total_steps=1)
    _train(big, big_stepper, [(x, y)])
    small_stepper = Stepper(
        small.parameters(), OptimConfig(lr=0.1, accumulate_steps=2), total_steps=1
    )
    assert _train(small, small_stepper, [(x[:4], y[:4]), (x[4:], y[4:])]) == [0.1]
    for a, b in zip(big.parameters(), small.parameters(), strict=True):
        torch.testing.assert_close(a, b)


def test_clipping_bounds_the_update() -> None:
    model = nn.Linear(1, 1, bias=False)
    model.weight.data.fill_(0.0)
    stepper = Stepper(model.parameters(), OptimConfig(lr=1.0, clip_grad_norm=0.5), total_steps=1)
    (model(torch.ones(1, 1)) * 100).sum().backward()
    assert stepper.step(0)
    assert stepper.last_grad_norm == pytest.approx(100.0)
    assert model.weight.item() == pytest.approx(-0.5)
