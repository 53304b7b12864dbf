"""What runs on the servers: embedding tables (as modules, and by name) and a write counter.

``LATENCY_S`` is set by the server process (``--latency-ms``): every request sleeps that long
first, standing in for network and server time.
"""

from __future__ import annotations

import threading
import time

import torch
import torch.distributed.rpc as rpc
from torch import nn

LATENCY_S = 0.0
NUM_ROWS = 64
DIM = 16

_TABLES: dict[str, torch.Tensor] = {}
_LOCK = threading.Lock()
COUNTS: dict[str, int] = {}


def _network() -> None:
    if LATENCY_S:
        time.sleep(LATENCY_S)


class EmbeddingTable(nn.Module):
    """A sum-pooled embedding table on a server (the RPC tutorials' ``EmbeddingTable``)."""

    def __init__(self, num_rows: int = NUM_ROWS, dim: int = DIM, seed: int = 0) -> None:
        super().__init__()
        self.emb = nn.EmbeddingBag(num_rows, dim, mode="sum")
        with torch.no_grad():
            self.emb.weight.copy_(
                torch.randn(num_rows, dim, generator=torch.Generator().manual_seed(seed))
            )

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        _network()
        return self.emb(ids)

    def parameter_rrefs(self) -> list:
        return [rpc.RRef(p) for p in self.parameters()]


class DropoutTable(EmbeddingTable):
    """An embedding table with dropout on the server: randomness verification must not trip on."""

    def __init__(
        self, num_rows: int = NUM_ROWS, dim: int = DIM, seed: int = 0, p: float = 0.5
    ) -> None:
        super().__init__(num_rows, dim, seed)
        self.drop = nn.Dropout(p)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.drop(super().forward(ids))


def create_table(name: str, seed: int) -> None:
    """Create (or reset) the named table on this server."""
    with _LOCK:
        _TABLES[name] = torch.randn(NUM_ROWS, DIM, generator=torch.Generator().manual_seed(seed))
        COUNTS[name] = 0


def lookup_rows(name: str, ids: torch.Tensor) -> torch.Tensor:
    """Sum of rows ``ids`` (``[B, bag]``) of the named table: ``[B, DIM]``."""
    _network()
    with _LOCK:
        table = _TABLES[name]
    return table[ids].sum(dim=1)


def bump_counter(name: str, amount: int) -> int:
    """A write: count ``amount`` more lookups of ``name``; returns the new count."""
    _network()
    with _LOCK:
        COUNTS[name] = COUNTS.get(name, 0) + amount
        return COUNTS[name]


def add_rows(name: str, ids: torch.Tensor, delta: float) -> None:
    """A write of the rows a lookup reads: add ``delta`` to rows ``ids`` of the named table."""
    _network()
    with _LOCK:
        _TABLES[name][ids.reshape(-1).unique()] += delta


STOP = threading.Event()


def stop_server() -> None:
    """Ask this server to leave the group (a process may join several groups in its life, and
    torch's graceful shutdown works only for its first). Stops just after answering."""
    threading.Timer(0.2, STOP.set).start()


def counter(name: str) -> int:
    with _LOCK:
        return COUNTS.get(name, 0)


def table_rows(name: str) -> torch.Tensor:
    with _LOCK:
        return _TABLES[name].clone()


def count_lookups(name: str, amount: int) -> None:
    """Counts lookups like :func:`bump_counter`, declared nowhere (tests/remote/test_undeclared.py)."""
    with _LOCK:
        COUNTS[name] = COUNTS.get(name, 0) + amount


def read_count(name: str, amount: int) -> int:
    """The lookups counted so far (``amount`` unused: the signature of :func:`count_lookups`);
    tests/remote/test_undeclared.py declares it a read."""
    with _LOCK:
        return COUNTS.get(name, 0)
