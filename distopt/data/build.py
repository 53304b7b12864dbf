"""From a :class:`~distopt.data.config.DataConfig` and the model to datasets and loaders.

The built-in sources read their shapes from the model: ``criteo`` from a DLRM-style
``model.config`` (``num_tables``, ``num_rows``, ``bag_size``), ``tokens`` from a GPT-style model's
``vocab_size`` and ``seq_len`` attributes. Files are opened (and validated) here, so a bad file
fails the job before its first step.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from torch import nn
from torch.utils.data import DataLoader, Dataset, IterableDataset

from distopt.data.batch import BatchCollate
from distopt.data.config import DataConfig, Task
from distopt.data.criteo import CriteoDataset, collate_criteo
from distopt.data.factory import call_factory, load_factory, takes
from distopt.data.loader import Loader, build_eval_loader, build_loader, holdout_split
from distopt.data.synthetic import SyntheticBatches
from distopt.data.tokens import TokenBlocks, TokenFile, TokenWindows, collate_tokens
from distopt.errors import ConfigError

AnyDataset = Dataset | IterableDataset


@dataclasses.dataclass(frozen=True)
class DataSource:
    """The datasets of a job and how to batch them."""

    train: AnyDataset
    eval: AnyDataset | None
    """Held-out data (finite), or ``None``."""
    collate_fn: Callable[[list[Any]], Any] | None
    batched: bool
    """Items are whole batches (synthetic data): loaders use ``batch_size=None``."""
    task: Task
    """What :func:`distopt.training.evaluate.evaluate` computes."""
    config: DataConfig

    def train_loader(self, *, rank: int, world_size: int, batch_size: int, seed: int) -> Loader:
        cfg = self.config
        return build_loader(
            self.train,
            rank=rank,
            world_size=world_size,
            batch_size=None if self.batched else batch_size,
            num_workers=cfg.num_workers,
            pin_memory=cfg.pin_memory,
            collate_fn=self.collate_fn,
            seed=seed,
            shuffle=cfg.shuffle,
            drop_last=cfg.drop_last,
        )

    def eval_loader(self, *, rank: int, world_size: int, batch_size: int) -> DataLoader | None:
        if self.eval is None:
            return None
        cfg = self.config
        return build_eval_loader(
            self.eval,
            rank=rank,
            world_size=world_size,
            batch_size=None if self.batched else batch_size,
            num_workers=cfg.num_workers,
            pin_memory=cfg.pin_memory,
            collate_fn=self.collate_fn,
        )


def _model_attr(model: nn.Module, owner: Any, name: str, source: str) -> int:
    value = getattr(owner, name, None)
    if not isinstance(value, int):
        raise ConfigError(
            f"data.source: {source} data needs a model with an integer {name!r} "
            f"({type(model).__name__} has {value!r})"
        )
    return value


def _criteo(cfg: DataConfig, model: nn.Module) -> tuple[AnyDataset, AnyDataset | None]:
    config = getattr(model, "config", None)
    shape = {
        name: _model_attr(model, config, name, "criteo")
        for name in ("num_tables", "num_rows", "bag_size")
    }

    def open_file(path: str, key: str) -> CriteoDataset:
        return CriteoDataset(
            path, **shape, table_of_feature=cfg.table_of_feature, key=key, cache_dir=cfg.cache_dir
        )

    assert cfg.path is not None  # DataConfig requires it
    train = open_file(cfg.path, "data.path")
    if cfg.eval_path is not None:
        return train, open_file(cfg.eval_path, "data.eval_path")
    if cfg.holdout_fraction:
        return holdout_split(train, cfg.holdout_fraction)
    return train, None


def _tokens(cfg: DataConfig, model: nn.Module, seed: int) -> tuple[AnyDataset, AnyDataset | None]:
    vocab_size = _model_attr(model, model, "vocab_size", "tokens")
    seq_len = _model_attr(model, model, "seq_len", "tokens")

    def open_file(path: str, key: str) -> TokenFile:
        return TokenFile(
            path, vocab_size=vocab_size, seq_len=seq_len, dtype=cfg.token_dtype, key=key
        )

    assert cfg.path is not None
    file = open_file(cfg.path, "data.path")
    if cfg.eval_path is not None:
        held_file = open_file(cfg.eval_path, "data.eval_path")
        return TokenWindows(file.region(), seed=seed), TokenBlocks(held_file.region())
    if cfg.holdout_fraction:
        train, held = file.split(cfg.holdout_fraction)
        return TokenWindows(train, seed=seed), TokenBlocks(held)
    return TokenWindows(file.region(), seed=seed), None


def _factory(cfg: DataConfig, seed: int) -> tuple[AnyDataset, AnyDataset | None, Any]:
    made = call_factory(cfg.source, cfg.kwargs, split="train", seed=seed)
    if made is None:
        raise ConfigError(f"data.source: {cfg.source!r} returned no training data")
    train, collate = made
    if takes(load_factory(cfg.source), "split"):
        held = call_factory(cfg.source, cfg.kwargs, split="eval", seed=seed)
        return train, None if held is None else held[0], collate
    if cfg.holdout_fraction:
        if isinstance(train, IterableDataset):
            raise ConfigError(
                f"data.holdout_fraction: {cfg.source!r} returned an IterableDataset, "
                "which cannot be split; give the factory a 'split' argument"
            )
        return (*holdout_split(train, cfg.holdout_fraction), collate)
    return train, None, collate


def build_data(
    cfg: DataConfig, *, model_name: str, model: nn.Module, batch_size: int, seed: int
) -> DataSource:
    """Open ``cfg``'s data for ``model`` (built from ``model_name``); validates files now."""
    collate: Any
    batched = False
    if cfg.source == "synthetic":
        train: AnyDataset = SyntheticBatches(
            model_name, model, batch_size=batch_size, num_batches=cfg.synthetic_batches, seed=seed
        )
        held, collate, batched = None, None, True
    elif cfg.source == "criteo":
        (train, held), collate = _criteo(cfg, model), collate_criteo
    elif cfg.source == "tokens":
        (train, held), collate = _tokens(cfg, model, seed), collate_tokens
    else:
        train, held, user_collate = _factory(cfg, seed)
        batched = bool(getattr(train, "batched", False))
        collate = None if batched else BatchCollate(user_collate)
    return DataSource(
        train=train,
        eval=held,
        collate_fn=collate,
        batched=batched,
        task=cfg.resolved_task,
        config=cfg,
    )


__all__ = ["DataSource", "build_data"]
