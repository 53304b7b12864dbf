"""The dense optimizer of a job: a ``torch.optim`` class by name, its learning-rate schedule,
gradient clipping and gradient accumulation (the ``optim:`` section of a job config).

Sparse tables on parameter servers have their own optimizer (``TableSpec.optimizer``); gradient
accumulation here covers dense parameters only, because a parameter-server trainer pushes the
gradients of fetched rows after every backward.

Schedule: one :class:`~torch.optim.lr_scheduler.LambdaLR` whose factor is a closed-form function of
the optimizer step (warm-up, then constant, linear or cosine decay). Not ``LinearLR`` +
``CosineAnnealingLR`` in a ``SequentialLR``: ``LinearLR`` cannot warm up from 0 (its start factor
must be > 0), ``SequentialLR`` hands over between schedulers by stepping them, which makes the lr
at a milestone depend on how the pieces compose, and resuming needs every piece's state. The factor
function below is rebuilt from the config; the checkpoint needs only ``last_epoch``.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
from collections.abc import Iterable
from typing import Any, Literal

import torch

from distopt.config import check
from distopt.errors import ConfigError

Decay = Literal["constant", "linear", "cosine"]


def optimizer_classes() -> dict[str, type[torch.optim.Optimizer]]:
    """Every optimizer class of ``torch.optim`` by lower-case name (``sgd``, ``adamw``, ...)."""
    return {
        name.lower(): cls
        for name, cls in vars(torch.optim).items()
        if isinstance(cls, type)
        and issubclass(cls, torch.optim.Optimizer)
        and cls is not torch.optim.Optimizer
    }


def accepted_arguments(cls: type[torch.optim.Optimizer]) -> tuple[str, ...]:
    """Keyword arguments of ``cls`` other than ``params`` and ``lr`` (``lr`` has its own key)."""
    parameters = inspect.signature(cls.__init__).parameters
    return tuple(
        n
        for n, p in parameters.items()
        if n not in ("self", "params", "lr") and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
    )


@dataclasses.dataclass(kw_only=True, slots=True)
class ScheduleConfig:
    """Learning rate over optimizer steps: linear warm-up, then a decay to ``min_lr_factor × lr``."""

    warmup_steps: int = 0
    """Steps of linear warm-up: step ``s < warmup_steps`` uses ``lr × (s + 1) / warmup_steps``."""
    decay: Decay = "constant"
    """After warm-up: keep ``lr`` (constant), or decay linearly or along a half cosine."""
    decay_steps: int | None = None
    """Length of the decay; ``None``: until the last step (``total_steps - warmup_steps``)."""
    min_lr_factor: float = 0.0
    """Where the decay ends, as a fraction of ``lr`` (held after ``decay_steps``)."""

    def __post_init__(self) -> None:
        check(
            self.warmup_steps >= 0,
            "optim.schedule.warmup_steps",
            "an integer >= 0",
            self.warmup_steps,
        )
        check(
            self.decay in ("constant", "linear", "cosine"),
            "optim.schedule.decay",
            "'constant', 'linear' or 'cosine'",
            self.decay,
        )
        if self.decay_steps is not None:
            check(
                self.decay_steps >= 1,
                "optim.schedule.decay_steps",
                "an integer >= 1",
                self.decay_steps,
            )
        check(
            0.0 <= self.min_lr_factor <= 1.0,
            "optim.schedule.min_lr_factor",
            "a number in [0, 1]",
            self.min_lr_factor,
        )

    def factor(self, step: int, total_steps: int) -> float:
        """Multiplier of ``lr`` at optimizer step ``step`` (0-based) of ``total_steps``."""
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        if self.decay == "constant":
            return 1.0
        length = self.decay_steps or max(1, total_steps - self.warmup_steps)
        progress = min(1.0, (step - self.warmup_steps) / length)
        shape = (
            1.0 - progress if self.decay == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))
        )
        return self.min_lr_factor + (1.0 - self.min_lr_factor) * shape


@dataclasses.dataclass(kw_only=True, slots=True)
class OptimConfig:
    """The dense optimizer, checked against ``torch.optim`` when the config is built."""

    name: str = "sgd"
    """A ``torch.optim`` class, case-insensitive: ``sgd``, ``adam``, ``adamw``, ``adagrad``, ..."""
    lr: float = 0.01
    """Peak learning rate (reached after warm-up)."""
    sparse_lr: float | None = None
    """Learning rate of parameter-server tables, whose optimizer is their own
    (``TableSpec.optimizer``: sgd, adagrad, rowwise_adagrad) and unscheduled; ``None``: ``lr``."""
    kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)
    """Other keyword arguments of the class, e.g. ``{betas: [0.9, 0.95], weight_decay: 0.1}``
    (lists become tuples)."""
    schedule: ScheduleConfig = dataclasses.field(default_factory=ScheduleConfig)
    """Learning-rate schedule over optimizer steps."""
    clip_grad_norm: float | None = None
    """Clip the gradients' total 2-norm to this before each optimizer step; ``None``: no clipping."""
    accumulate_steps: int = 1
    """Micro-batches per optimizer step: gradients of ``accumulate_steps`` backward passes (each
    loss scaled by ``1 / accumulate_steps``) are summed before one step."""

    def __post_init__(self) -> None:
        classes = optimizer_classes()
        if not isinstance(self.name, str) or self.name.lower() not in classes:
            known = ", ".join(sorted(classes))
            raise ConfigError(f"optim.name: unknown optimizer {self.name!r} (known: {known})")
        cls = classes[self.name.lower()]
        accepted = accepted_arguments(cls)
        for key in self.kwargs:
            if key not in accepted:
                raise ConfigError(
                    f"optim.kwargs.{key}: {cls.__name__} takes no argument {key!r} "
                    f"(accepted: {', '.join(accepted)})"
                )
        self.kwargs = {k: tuple(v) if isinstance(v, list) else v for k, v in self.kwargs.items()}
        check(self.lr > 0, "optim.lr", "a number > 0", self.lr)
        if self.sparse_lr is not None:
            check(self.sparse_lr > 0, "optim.sparse_lr", "a number > 0", self.sparse_lr)
        if self.clip_grad_norm is not None:
            check(
                self.clip_grad_norm > 0, "optim.clip_grad_norm", "a number > 0", self.clip_grad_norm
            )
        check(
            self.accumulate_steps >= 1,
            "optim.accumulate_steps",
            "an integer >= 1",
            self.accumulate_steps,
        )
        # Values are checked by the class itself (e.g. "Invalid beta parameter at index 0: 1.5"),
        # now rather than after the model is built: one throwaway parameter is enough.
        try:
            cls([torch.zeros(1, requires_grad=True)], lr=self.lr, **self.kwargs)  # type: ignore[call-arg]
        except (TypeError, ValueError, RuntimeError) as err:
            detail = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            raise ConfigError(
                f"optim.kwargs: {cls.__name__} rejects {self.kwargs!r}: {detail}"
            ) from None

    @property
    def table_lr(self) -> float:
        """The learning rate parameter-server pushes use: ``sparse_lr``, else ``lr``."""
        return self.lr if self.sparse_lr is None else self.sparse_lr

    @property
    def optimizer_class(self) -> type[torch.optim.Optimizer]:
        return optimizer_classes()[self.name.lower()]


def build_optimizer(params: Iterable[Any], cfg: OptimConfig) -> torch.optim.Optimizer:
    """``cfg``'s optimizer over ``params`` (tensors or parameter-group dicts)."""
    return cfg.optimizer_class(params, lr=cfg.lr, **cfg.kwargs)  # type: ignore[call-arg]


def build_scheduler(
    optimizer: torch.optim.Optimizer, cfg: OptimConfig, total_steps: int
) -> torch.optim.lr_scheduler.LambdaLR:
    """``cfg.schedule`` over ``total_steps`` optimizer steps; call ``step()`` after each
    ``optimizer.step()``. Resume with ``load_state_dict`` of a scheduler built the same way."""
    check(total_steps >= 1, "optim: total_steps", "an integer >= 1", total_steps)
    schedule = cfg.schedule
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: schedule.factor(step, total_steps)
    )


class Stepper:
    """One training step's optimizer work: loss scaling for accumulation, clipping, the optimizer
    and scheduler steps, and zeroing gradients; with one ``state_dict`` for checkpoints.

    Use per micro-batch ``i`` (counting from 0 over the whole run)::

        stepper.scale(loss).backward()
        stepper.step(i)   # steps the optimizer only when i + 1 is a multiple of accumulate_steps
    """

    def __init__(self, params: Iterable[Any], cfg: OptimConfig, *, total_steps: int) -> None:
        self.cfg = cfg
        self.optimizer = build_optimizer(params, cfg)
        self.params = [p for group in self.optimizer.param_groups for p in group["params"]]
        self.scheduler = build_scheduler(self.optimizer, cfg, total_steps)
        self.last_grad_norm: float | None = None
        """Total gradient norm before clipping at the last optimizer step (with clipping on)."""

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss / accumulate_steps``: the summed micro-batch gradients then average."""
        return loss / self.cfg.accumulate_steps if self.cfg.accumulate_steps > 1 else loss

    def step(self, micro_step: int) -> bool:
        """Finish micro-batch ``micro_step``; returns whether the optimizer stepped."""
        if (micro_step + 1) % self.cfg.accumulate_steps:
            return False
        if self.cfg.clip_grad_norm is not None:
            norm = torch.nn.utils.clip_grad_norm_(self.params, self.cfg.clip_grad_norm)
            self.last_grad_norm = float(norm)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return True

    @property
    def lr(self) -> float:
        """Learning rate of the next optimizer step (first parameter group)."""
        return float(self.optimizer.param_groups[0]["lr"])

    def state_dict(self) -> dict[str, Any]:
        return {"optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])


__all__ = [
    "OptimConfig",
    "ScheduleConfig",
    "Stepper",
    "accepted_arguments",
    "build_optimizer",
    "build_scheduler",
    "optimizer_classes",
]
