"""Our feature store: embedding tables that live in the parameter-server process ``ps0``.

Trainers reach it with plain torch RPC, ``rpc_sync("ps0", get, ...)``; the server process imports
this module when the first call arrives. Tables are made on first use, the same on every run.
"""

import time

import torch

import distopt

DIM = 8
SIZES = {"user": 1000, "item": 500, "shop": 50}
LATENCY_S = 0.005  # the store sits on another rack: a lookup answers after ~5 ms

_tables: dict[str, torch.Tensor] = {}


def _table(name: str) -> torch.Tensor:
    if name not in _tables:
        seed = sorted(SIZES).index(name)
        _tables[name] = 0.05 * torch.randn(SIZES[name], DIM, generator=torch.Generator().manual_seed(seed))
    return _tables[name]


@distopt.register_read  # only reads: distopt may send it early, and verification sends it once
def get(name: str, ids: torch.Tensor) -> torch.Tensor:
    time.sleep(LATENCY_S)
    return _table(name)[ids]


@distopt.register_write  # changes the table: distopt never sends it twice
def add(name: str, ids: torch.Tensor, delta: torch.Tensor) -> None:
    _table(name).index_add_(0, ids, delta)
