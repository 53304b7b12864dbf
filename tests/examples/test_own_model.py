"""examples/own_model: a user's model calling rpc_sync on a server, with a user data factory,
run as its docstring says (``python examples/own_model/run.py``) in both variants, and as the job
config's comment says (``distopt launch examples/own_model/job.yaml``)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from distopt.metrics import load_run
from tests.examples.scripts import ROOT, run_documented


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["baseline", "optimized"])
def test_own_rpc_model_trains_as_a_job(variant: str, tmp_path: Path) -> None:
    proc = run_documented(
        "python",
        "examples/own_model/run.py",
        "--steps",
        "120",
        "--out",
        tmp_path,
        "--variant",
        variant,
    )
    auc = float(re.search(r"held-out AUC (\d\.\d+)", proc.stdout).group(1))  # type: ignore[union-attr]
    assert auc > 0.85  # the labels follow the remote rows: it learned them through rpc_sync
    header = load_run(tmp_path / f"own-{variant}").ranks[0].header
    if variant == "optimized":
        # The prediction timed the user's own lookup on ps0 (there is no table of distopt's), and
        # rehearsed the whole step: its backward's own write (apply_gradient) not applied, its
        # arguments sent to ps0 in its place (a stand-in), none waited out at the read's latency.
        assert 0 < header["predicted_rpc_latency_s"] < 1
        how = header["predicted_phases"]["how"]["backward"]
        assert "1 remote write(s) per step not applied, 1 sent as stand-ins" in how, how
        assert "waited out" not in how, how
        assert header["predicted_phases"]["optimized"]["backward"] > 0
        assert 0 < header["predicted_gain"] < 10
    else:
        assert "predicted_gain" not in header


@pytest.mark.slow
def test_the_job_config_launches_as_its_comment_says(tmp_path: Path) -> None:
    proc = run_documented(
        "distopt",
        "launch",
        "examples/own_model/job.yaml",
        "--num-ps",
        "1",
        "--set",
        "steps=10",
        "--set",
        f"output_dir={tmp_path}",
        "--run-id",
        "own",
    )
    assert "SUCCEEDED" in proc.stdout + proc.stderr
    assert len(load_run(tmp_path / "own").ranks[0].steps) == 10


def test_model_and_data_without_a_job() -> None:
    """The pieces alone: the factory's batches fit the model's inputs (no RPC here)."""
    from examples.own_model.model import Clicks, make_dataset, make_model

    train, held = make_dataset("train", seed=0, size=64), make_dataset("eval", seed=0, size=64)
    assert len(train) == 64 and len(held) == 16
    batch = Clicks.collate_fn([train[i] for i in range(4)])
    dense, ids = batch.inputs
    assert dense.shape == (4, 4) and ids.shape == (4, 3) and batch.targets.shape == (4, 1)
    assert make_model().host_inputs == (1,)
    assert (ROOT / "examples/own_model/job.yaml").read_text().startswith("# Your own model")
