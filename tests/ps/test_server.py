"""Server-side handlers in-process (no RPC): the checkpoint files a server writes and reads."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from distopt.errors import ConfigError
from distopt.ps import server
from distopt.ps.spec import ServerOptions, TableSpec


@pytest.fixture
def fresh_state(monkeypatch: pytest.MonkeyPatch):
    def make() -> server._ServerState:
        tables = (TableSpec(name="emb", num_rows=8, dim=3, optimizer="rowwise_adagrad"),)
        state = server._ServerState(0, tables, ServerOptions(num_servers=1))
        monkeypatch.setattr(server, "_STATE", state)
        return state

    return make


def test_rowwise_adagrad_state_survives_the_server_checkpoint(fresh_state, tmp_path: Path) -> None:
    before = fresh_state()
    server.ps_server_push("emb", torch.tensor([1, 5, 5]), torch.randn(3, 3), 0.1)
    name, size = server.ps_server_save(str(tmp_path))
    assert name == "ps0.pt" and size > 0
    after = fresh_state()
    assert not torch.equal(after.table("emb").accum, before.table("emb").accum)
    server.ps_server_load(str(tmp_path))
    assert torch.equal(after.table("emb").weight, before.table("emb").weight)
    assert torch.equal(after.table("emb").accum, before.table("emb").accum)
    assert after.table("emb").accum.shape == (8,)


def test_a_batched_push_with_a_bad_row_or_gradient_changes_no_table(fresh_state) -> None:
    state = fresh_state()
    before = state.table("emb").weight.clone()
    with pytest.raises(ConfigError, match=r"row id 8 outside 0\.\.7"):
        server.ps_server_push_many([("emb", torch.tensor([1]), torch.ones(1, 3)),
                                    ("emb", torch.tensor([8]), torch.ones(1, 3))], 0.5)
    with pytest.raises(ConfigError, match=r"grads of shape \(2, 3\) for 1 ids of dim 3"):
        server.ps_server_push_many([("emb", torch.tensor([1]), torch.ones(1, 3)),
                                    ("emb", torch.tensor([2]), torch.ones(2, 3))], 0.5)
    assert torch.equal(state.table("emb").weight, before)
    server.ps_server_push_many([("emb", torch.tensor([1]), torch.ones(1, 3)),
                                ("emb", torch.tensor([1, 2]), torch.ones(2, 3))], 0.5)
    assert not torch.equal(state.table("emb").weight[1:3], before[1:3])
    assert torch.equal(state.table("emb").weight[3:], before[3:])
