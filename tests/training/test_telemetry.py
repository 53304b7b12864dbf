"""The recorder: step and eval records in the QPS log, TensorBoard scalars on trainer 0."""

from __future__ import annotations

import io
from pathlib import Path

import pytest

from distopt.metrics import QpsLogWriter, load_run
from distopt.training.evaluate import EvalResult
from distopt.training.progress import Progress
from distopt.training.telemetry import Recorder, tensorboard_writer


def test_steps_and_evaluations_reach_the_log_and_tensorboard(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    log = QpsLogWriter.create(
        tmp_path,
        run_id="r",
        variant="baseline",
        rank=0,
        world_size=1,
        global_batch_size=8,
        config={},
    )
    board = tensorboard_writer(tmp_path / "r" / "tensorboard")
    with Recorder(log, Progress(total=2, rank=0, log_every=1, stream=io.StringIO()), board) as rec:
        rec.step(0, 0.5, loss=0.7, lr=0.1, wait_s=0.01)
        rec.step(1, 0.25, loss=0.6, lr=0.05, wait_s=None)
        rec.evaluation(2, EvalResult(loss=0.55, samples=100, auc=0.8), 1.5)
    rank = load_run(tmp_path / "r").ranks[0]
    assert [(s.loss, s.lr, s.wait_s) for s in rank.steps] == [(0.7, 0.1, 0.01), (0.6, 0.05, None)]
    (evaluation,) = rank.evals
    assert evaluation.step == 2 and evaluation.eval_time_s == 1.5
    assert evaluation.metrics == {"eval_loss": 0.55, "eval_samples": 100, "eval_auc": 0.8}
    events = EventAccumulator(str(tmp_path / "r" / "tensorboard"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"train/loss", "train/qps", "train/lr", "train/wait_s", "eval/loss", "eval/auc"} <= tags
    assert [(e.step, e.value) for e in events.Scalars("train/qps")] == [(1, 16.0), (2, 32.0)]
    assert [e.step for e in events.Scalars("eval/auc")] == [2]
