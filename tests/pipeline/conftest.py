"""One real parameter server for the pipeline tests, with tables reset to their first state."""

from __future__ import annotations

import copy
from collections.abc import Iterator

import pytest
import torch

import distopt
import distopt.ps as ps
from distopt.models.dlrm import DLRM, DLRMConfig, dlrm_tables

# Few rows, so consecutive batches share rows and staleness is observable.
CONFIG = DLRMConfig(num_tables=3, num_rows=40, embedding_dim=8, batch_size=8, bag_size=3)


@pytest.fixture(scope="module")
def server() -> Iterator[dict[str, torch.Tensor]]:
    """A running job; yields the tables' initial state (restore it with ``ps.load_state_dict``)."""
    with ps.local_job(dlrm_tables(CONFIG), ps.ServerOptions(num_servers=1, start_timeout_s=30)):
        yield copy.deepcopy(ps.state_dict())


def optimized_dlrm(example: tuple[torch.Tensor, ...], seed: int = 0) -> torch.fx.GraphModule:
    torch.manual_seed(seed)
    gm = distopt.optimize(DLRM(CONFIG), example, strict=True)
    ps.discard_step()  # verification's fetches are no training step
    assert isinstance(gm, torch.fx.GraphModule)
    return gm


def bitwise_equal(a, b) -> bool:
    """Tensors, and dicts/lists/tuples of them, equal bit for bit (state dicts, tables, losses)."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(bitwise_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(bitwise_equal(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)
