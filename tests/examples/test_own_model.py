"""examples/own_model: a user's model calling rpc_sync on a server, with a user data factory."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.examples.test_dlrm_criteo import ROOT, load_example


@pytest.mark.slow
def test_own_rpc_model_trains_as_a_job(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    auc = load_example("examples/own_model/run.py").run(steps=120, out=tmp_path)
    assert auc > 0.85  # the labels follow the remote rows: it learned them through rpc_sync


def test_model_and_data_without_a_job() -> None:
    """The pieces alone: the factory's batches fit the model's inputs (no RPC here)."""
    from examples.own_model.model import Clicks, make_dataset, make_model

    train, held = make_dataset("train", seed=0, size=64), make_dataset("eval", seed=0, size=64)
    assert len(train) == 64 and len(held) == 16
    batch = Clicks.collate_fn([train[i] for i in range(4)])
    dense, ids = batch.inputs
    assert dense.shape == (4, 4) and ids.shape == (4, 3) and batch.targets.shape == (4, 1)
    assert make_model().host_inputs == (1,)
