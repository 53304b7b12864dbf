"""The ps_overlap benchmark trains its variants the way a job trains: the cost model it checks
rehearses a job's step, so a bench step in another order measures something else."""

from __future__ import annotations

import pytest
import torch

import distopt.ps as ps
from distopt.bench.ps_overlap import _train_chunk
from distopt.models.dlrm import DLRM, DLRMConfig, DLRMHandAsync, dlrm_tables, make_batch
from distopt.ps.spec import ServerOptions

CONFIG = DLRMConfig(num_tables=2, num_rows=40, embedding_dim=4, batch_size=4, bag_size=2)


class _Recorded(torch.optim.SGD):
    def __init__(self, params, events: list[str]) -> None:
        super().__init__(params, lr=0.1)
        self.events = events

    def step(self, closure=None):  # type: ignore[override]
        self.events.append("optimizer")
        return super().step(closure)


@pytest.mark.parametrize(
    ("model_class", "blocking"), [(DLRM, True), (DLRMHandAsync, False)], ids=["blocking", "async"]
)
def test_a_bench_step_pushes_right_after_its_backward_as_a_job_does(
    model_class: type[torch.nn.Module], blocking: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Pushed after the optimizer step, an async push left just before the next step's reads,
    # which wait for it (per-table order): Ray's optimized waits ran 3.8 ms over the rehearsal's.
    events: list[str] = []
    push = ps.push_gradients

    def recorded_push(*args, **kwargs):
        events.append("push")
        return push(*args, **kwargs)

    monkeypatch.setattr(ps, "push_gradients", recorded_push)
    options = ServerOptions(num_servers=1, latency_ms=0, start_timeout_s=20)
    with ps.local_job(dlrm_tables(CONFIG), options):
        model = model_class(CONFIG)
        batches = [make_batch(CONFIG, step) for step in range(3)]
        steps, phases = _train_chunk(
            model,
            CONFIG,
            batches,
            _Recorded(model.parameters(), events),
            blocking_push=blocking,
            lr=0.1,
        )
    assert events == ["push", "optimizer"] * 3
    assert len(steps) == len(phases) == 3
    assert all(p["pushes"] > 0 and p["optimizer"] > 0 for p in phases)
