"""One shard of one table, and its update math. Pure PyTorch, no RPC: unit-testable in-process.

Row ``r`` of a table placed on ``n`` servers is stored by shard ``r % n`` at local row ``r // n``.
Every method takes *global* row ids and checks they belong to this shard, so a misrouted request
fails loudly instead of touching the wrong row.

Every row has a version, the number of pushes that updated it since the shard was made or
loaded, and every shard an epoch, drawn anew whenever its rows are replaced: together they let a
trainer's cache prove a row it holds current (:meth:`ShardTable.fetch_versioned`; ``docs/cache.md``).
A row pushed by a cache also keeps that cache's writer token and the version its run of pushes
began at, so a cache's own pushes that its copy has not yet taken are not counted against it.
"""

from __future__ import annotations

import dataclasses
import math
import secrets
import threading
from typing import Any

import torch

from distopt.errors import ConfigError
from distopt.ps.spec import TableSpec


def initial_rows(spec: TableSpec, seed: int) -> torch.Tensor:
    """The whole table's initial values; equal for any sharding (each shard slices it)."""
    gen = torch.Generator().manual_seed(spec.table_seed(seed))
    return torch.randn(spec.num_rows, spec.dim, generator=gen) * spec.init_std


Grads = torch.Tensor | tuple[torch.Tensor, torch.Tensor]
"""A push's gradient rows as they travel: ``[n, dim]``, or packed (:func:`pack_rows`)."""

_BITS = {2: torch.int16, 4: torch.int32, 8: torch.int64}


def pack_rows(rows: torch.Tensor) -> Grads:
    """``rows`` (``[n, dim]``) as ``(distinct, repeats)`` when fewer bytes: ``distinct[i]``
    stands for ``repeats[i]`` consecutive rows bitwise equal to it. The rows of a sum- or
    mean-pooled bag share one gradient, so a push of bags of ``L`` ids sends about one row in
    ``L``; :func:`unpack_rows` gives back the same bits, so the server's update is unchanged.
    Else ``rows`` itself."""
    n = rows.shape[0]
    bits = _BITS.get(rows.element_size())
    if n < 2 or rows.dim() != 2 or bits is None:
        return rows
    as_bits = rows.view(bits)  # bitwise: -0.0 is not 0.0, a NaN equals its own bits
    starts = torch.ones(n, dtype=torch.bool)
    starts[1:] = (as_bits[1:] != as_bits[:-1]).any(dim=1)
    first = starts.nonzero().squeeze(1)
    saved = (n - first.numel()) * rows.shape[1] * rows.element_size()
    if saved <= first.numel() * 4:  # each distinct row costs a 4-byte count
        return rows
    ends = torch.cat([first[1:], torch.tensor([n])])
    return rows.index_select(0, first), (ends - first).to(torch.int32)


def unpack_rows(grads: Grads) -> torch.Tensor:
    """The ``[n, dim]`` rows of :func:`pack_rows`'s result (a plain tensor as it is)."""
    if isinstance(grads, torch.Tensor):
        return grads
    distinct, repeats = grads
    return distinct.repeat_interleave(repeats.to(torch.int64), dim=0)


def grads_nbytes(grads: Grads) -> int:
    """Bytes of the tensors a push's gradient rows travel as."""
    tensors = (grads,) if isinstance(grads, torch.Tensor) else grads
    return sum(t.numel() * t.element_size() for t in tensors)


def accumulate(ids: torch.Tensor, grads: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum the gradient rows of duplicate ids: ``(unique_ids, summed_grads)``."""
    unique, inverse = torch.unique(ids, return_inverse=True)
    summed = torch.zeros(len(unique), grads.shape[1], dtype=grads.dtype)
    summed.index_add_(0, inverse, grads)
    return unique, summed


def step_rows(
    spec: TableSpec,
    weight: torch.Tensor,
    accum: torch.Tensor | None,
    rows: torch.Tensor,
    summed: torch.Tensor,
    lr: float,
    *,
    dry: bool = False,
) -> None:
    """The table's sparse optimizer step, in place, on rows ``rows`` (unique) of ``weight`` and
    ``accum`` with the summed gradient rows ``summed``.

    The one place of the update math: a server applies it to its shard, a trainer's cache
    (:mod:`distopt.ps.client.cache`) to its copies of the same rows with the same tensors, so
    its copies stay bitwise equal to the server's.

    ``dry``: the same kernels on the same rows of the same tensors, writing back what was there
    (a dry-run push, :meth:`ShardTable.rehearse`). ``weight`` gets ``-lr × ±0.0``, which is -0.0
    whatever the sign of ``lr``, and ``x + -0.0`` is ``x`` bitwise for every float, -0.0 and NaN
    included.
    """
    if accum is None:
        delta = summed
    else:
        accum_rows = accum.index_select(0, rows)
        kept = accum_rows.clone() if dry else accum_rows
        if accum.dim() == 1:  # row-wise: the row's mean squared gradient, one scalar per row
            denom = accum_rows.add_(summed.square().mean(dim=1)).sqrt().add_(spec.adagrad_eps)
            denom = denom.unsqueeze(1)
        else:
            denom = accum_rows.addcmul_(summed, summed).sqrt().add_(spec.adagrad_eps)
        accum.index_copy_(0, rows, kept)
        delta = summed / denom
    if dry:
        delta = torch.full_like(delta, math.copysign(0.0, lr))
    weight.index_add_(0, rows, delta, alpha=-lr)


def new_epoch() -> int:
    """A shard's epoch: drawn at random, so no two incarnations of a shard share one."""
    return secrets.randbits(62)


@dataclasses.dataclass(frozen=True, slots=True)
class VersionedRows:
    """A server's answer to a cache (:meth:`ShardTable.fetch_versioned`)."""

    epoch: int
    """The shard's epoch: versions of another epoch say nothing about these rows."""
    sent: torch.Tensor
    """Positions (in the request) of the rows sent: those the trainer did not hold current."""
    versions: torch.Tensor
    """The version of each row sent (int64, in the order of ``sent``)."""
    rows: torch.Tensor
    """``[len(sent), dim]`` weights of the rows sent."""
    state: torch.Tensor | None
    """Their optimizer state (Adagrad accumulators), ``None`` for SGD tables."""
    missed: torch.Tensor
    """Per row not sent (request order): how many pushes of other writers its held version
    may lack (at most the bound; an upper bound where they interleave with the cache's own)."""

    def fields(
        self,
    ) -> tuple[int, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """The fields in order, as a plain tuple (how it crosses the wire)."""
        return (self.epoch, self.sent, self.versions, self.rows, self.state, self.missed)

    @property
    def nbytes(self) -> int:
        tensors = (self.sent, self.versions, self.rows, self.state, self.missed)
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)


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
        self.version = torch.zeros(self.weight.shape[0], dtype=torch.int64)
        """Pushes applied to each local row since this shard was made or loaded."""
        self.writer: torch.Tensor | None = None
        """Per local row, the writer token of the cache whose push updated it last (0: a push
        without a cache); made on the first push with a token."""
        self.run_from: torch.Tensor | None = None
        """Per local row, its version when the last writer's unbroken run of pushes began."""
        self.epoch = new_epoch()

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

    def fetch_versioned(
        self,
        ids: torch.Tensor,
        held: torch.Tensor,
        epoch: int,
        bound: int | torch.Tensor,
        writer: int = 0,
    ) -> VersionedRows:
        """Rows ``ids`` a cache lacks or holds out of date: the rows (optimizer state and
        versions) of those whose ``held`` version is negative (not held), of another ``epoch``,
        or that lack more than ``bound`` (per row, or one for all) pushes of writers other than
        ``writer`` (the asking cache's token; 0: none).

        A held version ``h`` is the server's version the copy took every update up to (the
        cache's own pushes answered since included). The pushes after ``h`` are the writer's own,
        not yet answered when it asked, when the row's last writer is ``writer`` and its run
        began at ``h`` or before: they do not count. Otherwise each push after ``h`` counts,
        except those of the writer's final run (an upper bound when the writer's pushes and
        others' interleave)."""
        local = self.local_ids(ids)
        if not isinstance(held, torch.Tensor) or held.shape != local.shape:
            raise ConfigError(
                f"table {self.spec.name!r}: held versions {held!r} do not match {local.numel()} ids"
            )
        held = held.to(torch.int64)
        with self.lock:
            versions = self.version.index_select(0, local)
            missed = versions - held
            if writer and self.writer is not None and self.run_from is not None:
                own = self.writer.index_select(0, local) == writer
                others = (self.run_from.index_select(0, local) - held).clamp(min=0)
                missed = torch.where(own, others, missed)
            if epoch != self.epoch:
                stale = torch.ones(local.numel(), dtype=torch.bool)
            else:
                stale = (held < 0) | (missed > bound)
            sent = stale.nonzero().squeeze(1)
            picked = local.index_select(0, sent)
            rows = self.weight.index_select(0, picked)
            state = None if self.accum is None else self.accum.index_select(0, picked)
            return VersionedRows(
                self.epoch, sent, versions.index_select(0, sent), rows, state, missed[~stale]
            )

    def checked(self, ids: torch.Tensor, grads: Grads) -> tuple[torch.Tensor, torch.Tensor]:
        """Local rows of ``ids`` and ``grads`` (plain or packed: :func:`pack_rows`) as
        ``[len(ids), dim]``, or an error naming the table."""
        local = self.local_ids(ids)
        if not isinstance(grads, torch.Tensor):
            grads = self._unpacked(grads, local.numel())
        if not isinstance(grads, torch.Tensor) or not grads.is_floating_point():
            raise ConfigError(
                f"table {self.spec.name!r}: grads must be a float tensor, got {_shapes(grads)}"
            )
        if grads.numel() % self.spec.dim or grads.numel() // self.spec.dim != local.numel():
            raise ConfigError(
                f"table {self.spec.name!r}: grads of shape {tuple(grads.shape)} for "
                f"{local.numel()} ids of dim {self.spec.dim}"
            )
        return local, grads.reshape(local.numel(), self.spec.dim)

    def _unpacked(self, grads: Any, count: int) -> torch.Tensor:
        """Packed gradient rows for ``count`` ids as ``[count, dim]``, or an error naming the
        table."""
        pair = isinstance(grads, tuple | list) and len(grads) == 2  # Ray may hand back a list
        distinct, repeats = grads if pair else (None, None)
        if (
            not isinstance(distinct, torch.Tensor)
            or not isinstance(repeats, torch.Tensor)
            or distinct.dim() != 2
            or repeats.dim() != 1
            or repeats.dtype not in (torch.int32, torch.int64)
            or repeats.numel() != distinct.shape[0]
            or (repeats.numel() and int(repeats.min()) < 1)
            or int(repeats.sum()) != count
        ):
            raise ConfigError(
                f"table {self.spec.name!r}: packed grads {_shapes(grads)} do not give {count} "
                "rows (expected (distinct rows [m, dim], repeats [m] >= 1 summing to the ids))"
            )
        return unpack_rows((distinct, repeats))

    def push(
        self, ids: torch.Tensor, grads: Grads, lr: float, writer: int = 0
    ) -> tuple[int, torch.Tensor, torch.Tensor]:
        """Apply the table's sparse optimizer to rows ``ids`` with gradient rows ``grads``;
        returns what :meth:`apply` does."""
        return self.apply(*self.checked(ids, grads), lr, writer)

    def apply(
        self, local: torch.Tensor, grads: torch.Tensor, lr: float, writer: int = 0
    ) -> tuple[int, torch.Tensor, torch.Tensor]:
        """:meth:`push` of rows and gradients :meth:`checked` already returned, by ``writer``
        (a cache's token; 0: none). Returns the shard's epoch, each updated row's version
        before this push and the version the writer's unbroken run of pushes to it, this one
        included, began at (rows in ascending id order, duplicates once): what a cache needs
        to know its copies took the same updates, and whether the versions it lacks are its
        own."""
        if local.numel() == 0:
            empty = torch.zeros(0, dtype=torch.int64)
            return self.epoch, empty, empty
        rows, summed = accumulate(local, grads.to(self.weight.dtype))
        with self.lock:
            before = self.version.index_select(0, rows)
            step_rows(self.spec, self.weight, self.accum, rows, summed, lr)
            self.version.index_copy_(0, rows, before + 1)
            if writer and self.writer is None:
                self.writer = torch.zeros_like(self.version)
                self.run_from = torch.zeros_like(self.version)
            run = before
            if self.writer is not None and self.run_from is not None:
                same = self.writer.index_select(0, rows) == writer
                run = torch.where(same, self.run_from.index_select(0, rows), before)
                self.run_from.index_copy_(0, rows, run)
                self.writer.index_fill_(0, rows, writer)
            return self.epoch, before, run

    def rehearse(self, local: torch.Tensor, grads: torch.Tensor, lr: float) -> None:
        """The work of :meth:`apply`, kernel for kernel on the same rows, writing back what was
        there (:func:`step_rows` with ``dry``): the shard is left as it was, bitwise (the cost
        model times a push this way).

        The same kernels on the same rows, not the update on copies of them: an update of rows
        scattered over tables larger than the CPU's caches costs what its writes to them cost.
        On copies, a dry run of 16 tables of 10,000 rows took 0.70 ms where the push took 1.10
        (``index_add_`` with an ``alpha`` on cold rows), and ps_overlap's optimized steps ran
        about 10% longer than rehearsed at K = 16, 1 ms, light (docs/cost_model.md).

        Under the lock, as :meth:`apply` holds it: the fetches a real push keeps waiting (a
        pipeline's next reads, sent while it pushes) wait as long for a dry run. With the math
        outside the lock they ran beside it, and a rehearsed pipeline took its prefetched
        batches sooner than the job does (ps_overlap K = 16, 1 ms, light: ``data`` 2.7 ms
        rehearsed, 5.2 ms measured)."""
        if local.numel() == 0:
            return
        rows, summed = accumulate(local, grads.to(self.weight.dtype))
        with self.lock:
            before = self.version.index_select(0, rows)
            step_rows(self.spec, self.weight, self.accum, rows, summed, lr, dry=True)
            self.version.index_copy_(0, rows, before)

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
            self.version.zero_()
            self.writer = self.run_from = None
            self.epoch = new_epoch()  # every cached copy of this shard is void


def _shapes(value: Any) -> str:
    """``value`` in one line: tensors by dtype and shape."""
    if isinstance(value, torch.Tensor):
        return f"{str(value.dtype).removeprefix('torch.')}{list(value.shape)}"
    if isinstance(value, tuple | list):
        return "(" + ", ".join(_shapes(v) for v in value) + ")"
    return repr(value)


def _describe(accum_shape: tuple[int, ...] | None) -> str:
    return "none" if accum_shape is None else f"an accumulator of shape {accum_shape}"
