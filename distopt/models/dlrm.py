"""DLRM-style reference workload with remote embedding tables (the parameter-server benchmark).

``DLRM`` is written the way users write it: each of the K tables is fetched with a blocking
``distopt.ps.fetch`` right before its use, interleaved with that table's dense tower, so the CPU
idles for a round trip K times per step. ``DLRMHandAsync`` is the SAME model (same submodules,
parameter names and arithmetic order) written by hand the ideal way: every fetch is issued first
with ``fetch_async`` and waited right before its use. Both give identical outputs and gradients.

Forward (B = batch, D = embedding dim)::

    h = bottom_mlp(dense)                         # [B, D]
    for k in range(K):
        t_k = towers[k](h)                        # dense work that can hide fetch latency
        e_k = sum-pool(fetch(table_k, ids[k]))    # [B, D]
        f_k = t_k + e_k
    z = pairwise dots of (h, f_0 .. f_{K-1})      # [B, (K+1)K/2]
    logit = top_mlp(cat(h, z))                    # [B, 1]
"""

from __future__ import annotations

import dataclasses
import math
from typing import Literal

import torch
from torch import nn

import distopt.ps as ps
from distopt.config import check, from_dict
from distopt.models import register_model
from distopt.models.ids import zipf_ids
from distopt.ps.spec import TableSpec

_TOWER_PRESETS = {"light": (64,), "heavy": (1024, 1024)}


@dataclasses.dataclass(kw_only=True, slots=True)
class DLRMConfig:
    """Sizes of the DLRM reference model and its tables."""

    num_tables: int = 4
    """K: remote embedding tables, one fetch each per forward."""
    num_rows: int = 10_000
    """Rows per table."""
    embedding_dim: int = 16
    """Width of embedding rows (and of every tower output)."""
    bag_size: int = 4
    """Ids per sample per table, sum-pooled."""
    dense_features: int = 13
    """Width of the dense input."""
    bottom_mlp: tuple[int, ...] = (64,)
    """Hidden widths of the bottom MLP (its output width is ``embedding_dim``)."""
    top_mlp: tuple[int, ...] = (64,)
    """Hidden widths of the top MLP (its output width is 1)."""
    compute: Literal["light", "heavy"] = "light"
    """Dense work per table tower: light ``(64,)`` or heavy ``(1024, 1024)`` hidden widths."""
    tower_hidden: tuple[int, ...] | None = None
    """Explicit tower hidden widths; overrides ``compute``."""
    batch_size: int = 64
    """Samples per batch from :func:`make_batch`."""
    optimizer: Literal["sgd", "adagrad", "rowwise_adagrad"] = "sgd"
    """Sparse optimizer of the tables on the servers."""
    table_prefix: str = "emb"
    """Tables are named ``<prefix>0 .. <prefix>{K-1}``."""
    seed: int = 0
    """Seed of the dense parameters and of the input batches."""
    id_alpha: float | None = None
    """Zipf exponent of the synthetic ids (:func:`distopt.models.ids.zipf_ids`: id ``i`` with
    probability ∝ ``(i + 1)^-id_alpha``, id 0 the hottest; 1.05 is typical of click logs);
    ``None``: uniform ids."""

    def __post_init__(self) -> None:
        check(self.num_tables >= 1, "dlrm.num_tables", "an integer >= 1", self.num_tables)
        check(self.num_rows >= 1, "dlrm.num_rows", "an integer >= 1", self.num_rows)
        check(self.embedding_dim >= 1, "dlrm.embedding_dim", "an integer >= 1", self.embedding_dim)
        check(self.bag_size >= 1, "dlrm.bag_size", "an integer >= 1", self.bag_size)
        check(
            self.dense_features >= 1, "dlrm.dense_features", "an integer >= 1", self.dense_features
        )
        check(self.batch_size >= 1, "dlrm.batch_size", "an integer >= 1", self.batch_size)
        check(
            self.id_alpha is None or (math.isfinite(self.id_alpha) and self.id_alpha > 0),
            "dlrm.id_alpha",
            "a Zipf exponent > 0, or null for uniform ids",
            self.id_alpha,
        )
        check(self.compute in _TOWER_PRESETS, "dlrm.compute", "'light' or 'heavy'", self.compute)
        for key in ("bottom_mlp", "top_mlp"):
            widths = getattr(self, key)
            check(all(w >= 1 for w in widths), f"dlrm.{key}", "positive widths", widths)

    @property
    def tower_widths(self) -> tuple[int, ...]:
        return self.tower_hidden if self.tower_hidden is not None else _TOWER_PRESETS[self.compute]

    @property
    def table_names(self) -> tuple[str, ...]:
        return tuple(f"{self.table_prefix}{k}" for k in range(self.num_tables))


def dlrm_tables(config: DLRMConfig) -> tuple[TableSpec, ...]:
    """Specs of the model's remote tables (for ``distopt.ps.start_servers``)."""
    return tuple(
        TableSpec(
            name=name,
            num_rows=config.num_rows,
            dim=config.embedding_dim,
            optimizer=config.optimizer,
        )
        for name in config.table_names
    )


def _mlp(widths: tuple[int, ...], out: int, last_relu: bool) -> nn.Sequential:
    layers: list[nn.Module] = []
    for width_in, width_out in zip(widths[:-1], widths[1:], strict=True):
        layers += [nn.Linear(width_in, width_out), nn.ReLU()]
    layers.append(nn.Linear(widths[-1], out))
    if last_relu:
        layers.append(nn.ReLU())
    return nn.Sequential(*layers)


@dataclasses.dataclass(frozen=True)
class DLRMBatch:
    dense: torch.Tensor
    """``[B, dense_features]`` float."""
    sparse: torch.Tensor
    """``[K, B, bag_size]`` row ids, one slab per table."""
    labels: torch.Tensor
    """``[B, 1]`` click labels in {0, 1}."""


def sparse_ids(
    config: DLRMConfig, batch_size: int, generator: torch.Generator | None
) -> torch.Tensor:
    """``[K, batch_size, bag_size]`` synthetic row ids: uniform, or Zipf(``config.id_alpha``)."""
    shape = (config.num_tables, batch_size, config.bag_size)
    if config.id_alpha is None:
        return torch.randint(0, config.num_rows, shape, generator=generator)
    return zipf_ids(shape, num_rows=config.num_rows, alpha=config.id_alpha, generator=generator)


def make_batch(config: DLRMConfig, step: int, *, rank: int = 0) -> DLRMBatch:
    """Batch ``step`` of trainer ``rank``: the same for the same ``(seed, step, rank)``."""
    gen = torch.Generator().manual_seed(config.seed * 1_000_003 + step * 7919 + rank)
    dense = torch.randn(config.batch_size, config.dense_features, generator=gen)
    sparse = sparse_ids(config, config.batch_size, gen)
    labels = torch.randint(0, 2, (config.batch_size, 1), generator=gen).float()
    return DLRMBatch(dense=dense, sparse=sparse, labels=labels)


class DLRM(nn.Module):
    """The DLRM reference model as written: blocking fetch right before each use."""

    pair_rows: torch.Tensor  # buffers registered in _build
    pair_cols: torch.Tensor
    host_inputs = (1,)
    """``sparse`` stays in host memory on a GPU trainer: its ids only address server rows."""

    def __init__(self, config: DLRMConfig) -> None:
        super().__init__()
        with torch.random.fork_rng():  # same seed → same dense parameters in every variant
            torch.manual_seed(config.seed)
            self._build(config)

    def _build(self, config: DLRMConfig) -> None:
        dim = config.embedding_dim
        self.config = config
        self.tables = list(config.table_names)  # plain strings: constants in a traced graph
        self.bottom = _mlp((config.dense_features, *config.bottom_mlp), dim, last_relu=True)
        self.towers = nn.ModuleList(
            _mlp((dim, *config.tower_widths), dim, last_relu=False) for _ in self.tables
        )
        k = len(self.tables)
        self.top = _mlp((dim + (k + 1) * k // 2, *config.top_mlp), 1, last_relu=False)
        rows, cols = torch.triu_indices(k + 1, k + 1, offset=1)
        self.register_buffer("pair_rows", rows, persistent=False)
        self.register_buffer("pair_cols", cols, persistent=False)

    def interact(self, h: torch.Tensor, features: list[torch.Tensor]) -> torch.Tensor:
        stacked = torch.stack([h, *features], dim=1)  # [B, K+1, D]
        dots = torch.bmm(stacked, stacked.transpose(1, 2))  # [B, K+1, K+1]
        pairs = dots[:, self.pair_rows, self.pair_cols]  # [B, (K+1)K/2]
        return self.top(torch.cat([h, pairs], dim=1))

    def forward(self, dense: torch.Tensor, sparse: torch.Tensor) -> torch.Tensor:
        h = self.bottom(dense)
        features = []
        for k, tower in enumerate(self.towers):
            t = tower(h)
            rows = ps.fetch(self.tables[k], sparse[k])  # blocking, right before use
            features.append(t + rows.sum(dim=1))
        return self.interact(h, features)

    def ps_tables(self) -> tuple[TableSpec, ...]:
        """The parameter-server tables this model fetches from (``python -m distopt.train`` asks)."""
        return dlrm_tables(self.config)

    def example_inputs(
        self, batch_size: int, *, generator: torch.Generator | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        cfg = self.config
        dense = torch.randn(batch_size, cfg.dense_features, generator=generator)
        return dense, sparse_ids(cfg, batch_size, generator)


class DLRMHandAsync(DLRM):
    """The same model, hand-optimized: all fetches issued up front, each waited right before use."""

    def forward(self, dense: torch.Tensor, sparse: torch.Tensor) -> torch.Tensor:
        futures = [ps.fetch_async(table, sparse[k]) for k, table in enumerate(self.tables)]
        h = self.bottom(dense)
        features = []
        for k, tower in enumerate(self.towers):
            t = tower(h)
            rows = ps.wait(futures[k])
            features.append(t + rows.sum(dim=1))
        return self.interact(h, features)


def dlrm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return nn.functional.binary_cross_entropy_with_logits(logits, labels)


@register_model("dlrm")
def dlrm(**kwargs: object) -> DLRM:
    """Registered factory: ``build("dlrm", num_tables=4, compute="heavy", ...)`` (needs a PS job)."""
    return DLRM(from_dict(DLRMConfig, kwargs))


@register_model("dlrm_hand_async")
def dlrm_hand_async(**kwargs: object) -> DLRMHandAsync:
    return DLRMHandAsync(from_dict(DLRMConfig, kwargs))
