"""One shard of one table, and its update math. Pure PyTorch, no RPC: unit-testable in-process.

Row ``r`` of a table placed on ``n`` servers is stored by shard ``r % n`` at local row ``r // n``.
Every method takes *global* row ids and checks they belong to this shard, so a misrouted request
fails loudly instead of touching the wrong row.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from distopt.errors import ConfigError
from distopt.ps.spec import TableSpec


def initial_rows(spec: TableSpec, seed: int) -> torch.Tensor:
    """The whole table's initial values; equal for any sharding (each shard slices it)."""
    gen = torch.Generator().manual_seed(spec.table_seed(seed))
    return torch.randn(spec.num_rows, spec.dim, generator=gen) * spec.init_std


def accumulate(ids: torch.Tensor, grads: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum the gradient rows of duplicate ids: ``(unique_ids, summed_grads)``."""
    unique, inverse = torch.unique(ids, return_inverse=True)
    summed = torch.zeros(len(unique), grads.shape[1], dtype=grads.dtype)
    summed.index_add_(0, inverse, grads)
    return unique, summed


class ShardTable:
    """Shard ``shard`` of ``num_shards`` of table ``spec``, guarded by a lock.

    RPC handlers run on a thread pool, so every read and update holds ``self.lock``: a fetch never
    sees a half-applied push.
    """

    def __init__(self, spec: TableSpec, *, shard: int, num_shards: int, seed: int = 0) -> None:
        if not 0 <= shard < num_shards:
            raise ConfigError(f"table {spec.name!r}: shard {shard} outside 0..{num_shards - 1}")
        self.spec = spec
        self.shard = shard
        self.num_shards = num_shards
        self.lock = threading.Lock()
        self.weight = initial_rows(spec, seed)[shard::num_shards].clone()
        self.accum: torch.Tensor | None = None
        """Adagrad's squared-gradient sums: ``[rows, dim]`` (adagrad), ``[rows]`` (row-wise)."""
        if spec.optimizer == "adagrad":
            self.accum = torch.full_like(self.weight, spec.adagrad_initial)
        elif spec.optimizer == "rowwise_adagrad":
            self.accum = torch.full(
                (self.weight.shape[0],), spec.adagrad_initial, dtype=self.weight.dtype
            )

    @property
    def num_local_rows(self) -> int:
        return self.weight.shape[0]

    def local_ids(self, ids: torch.Tensor) -> torch.Tensor:
        """Global ids → local row indices, rejecting ids out of range or of another shard."""
        if not isinstance(ids, torch.Tensor) or ids.dtype not in (torch.int64, torch.int32):
            raise ConfigError(
                f"table {self.spec.name!r}: ids must be an integer tensor, got {ids!r}"
            )
        ids = ids.reshape(-1).to(torch.int64)
        if ids.numel() == 0:
            return ids
        low, high = int(ids.min()), int(ids.max())
        if low < 0 or high >= self.spec.num_rows:
            bad = low if low < 0 else high
            raise ConfigError(
                f"table {self.spec.name!r}: row id {bad} outside 0..{self.spec.num_rows - 1}"
            )
        if self.num_shards > 1:
            wrong = ids[ids % self.num_shards != self.shard]
            if wrong.numel():
                raise ConfigError(
                    f"table {self.spec.name!r}: row id {int(wrong[0])} belongs to shard "
                    f"{int(wrong[0]) % self.num_shards}, not shard {self.shard}"
                )
        return ids // self.num_shards

    def fetch(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` as a new ``[len(ids), dim]`` tensor (a copy: later pushes don't change it)."""
        local = self.local_ids(ids)
        with self.lock:
            return self.weight.index_select(0, local)

    def checked(self, ids: torch.Tensor, grads: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Local rows of ``ids`` and ``grads`` as ``[len(ids), dim]``, or an error naming the table."""
        local = self.local_ids(ids)
        if not isinstance(grads, torch.Tensor) or not grads.is_floating_point():
            raise ConfigError(
                f"table {self.spec.name!r}: grads must be a float tensor, got {grads!r}"
            )
        if grads.numel() % self.spec.dim or grads.numel() // self.spec.dim != local.numel():
            raise ConfigError(
                f"table {self.spec.name!r}: grads of shape {tuple(grads.shape)} for "
                f"{local.numel()} ids of dim {self.spec.dim}"
            )
        return local, grads.reshape(local.numel(), self.spec.dim)

    def push(self, ids: torch.Tensor, grads: torch.Tensor, lr: float) -> None:
        """Apply the table's sparse optimizer to rows ``ids`` with gradient rows ``grads``."""
        self.apply(*self.checked(ids, grads), lr)

    def apply(self, local: torch.Tensor, grads: torch.Tensor, lr: float) -> None:
        """:meth:`push` of rows and gradients :meth:`checked` already returned."""
        if local.numel() == 0:
            return
        rows, summed = accumulate(local, grads.to(self.weight.dtype))
        with self.lock:
            if self.accum is None:
                self.weight.index_add_(0, rows, summed, alpha=-lr)
                return
            if (
                self.accum.dim() == 1
            ):  # row-wise: the row's mean squared gradient, one scalar per row
                accum = self.accum.index_select(0, rows).add_(summed.square().mean(dim=1))
                denom = accum.sqrt().add_(self.spec.adagrad_eps).unsqueeze(1)
            else:
                accum = self.accum.index_select(0, rows).addcmul_(summed, summed)
                denom = accum.sqrt().add_(self.spec.adagrad_eps)
            self.accum.index_copy_(0, rows, accum)
            self.weight.index_add_(0, rows, summed / denom, alpha=-lr)

    def state_dict(self) -> dict[str, Any]:
        """Copies of this shard's tensors plus where it sits, for checkpoints."""
        with self.lock:
            state: dict[str, Any] = {
                "weight": self.weight.clone(),
                "shard": self.shard,
                "num_shards": self.num_shards,
            }
            if self.accum is not None:
                state["accum"] = self.accum.clone()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict` of the same shard (same sharding, shape and optimizer)."""
        where = f"table {self.spec.name!r} shard {self.shard}"
        if (state.get("shard"), state.get("num_shards")) != (self.shard, self.num_shards):
            got = f"shard {state.get('shard')} of {state.get('num_shards')}"
            raise ConfigError(
                f"{where}: checkpoint holds {got}, not shard {self.shard} of {self.num_shards}"
            )
        weight = state.get("weight")
        if not isinstance(weight, torch.Tensor) or weight.shape != self.weight.shape:
            shape = getattr(weight, "shape", None)
            raise ConfigError(
                f"{where}: checkpoint weight shape {shape}, expected {tuple(self.weight.shape)}"
            )
        accum = state.get("accum")
        held = tuple(accum.shape) if isinstance(accum, torch.Tensor) else None
        expected = None if self.accum is None else tuple(self.accum.shape)
        if (
            held != expected
        ):  # e.g. an adagrad checkpoint ([rows, dim]) into a row-wise table ([rows])
            raise ConfigError(
                f"{where}: checkpoint optimizer state {_describe(held)} does not match optimizer "
                f"{self.spec.optimizer!r}, which keeps {_describe(expected)}"
            )
        with self.lock:
            self.weight.copy_(weight)
            if self.accum is not None:
                self.accum.copy_(state["accum"])


def _describe(accum_shape: tuple[int, ...] | None) -> str:
    return "none" if accum_shape is None else f"an accumulator of shape {accum_shape}"
