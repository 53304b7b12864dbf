"""JobConfig validation: unknown keys, wrong types and bad values name the key."""

from __future__ import annotations

from pathlib import Path

import pytest

from distopt.config import from_dict, load_config
from distopt.errors import ConfigError
from distopt.training.config import JobConfig

CONFIGS = Path(__file__).resolve().parents[2] / "configs" / "jobs"


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("*.yaml")), ids=lambda p: p.name)
def test_shipped_job_configs_load(path: Path) -> None:
    config = load_config(JobConfig, path)
    from distopt import models

    assert config.model in models.names()


def test_variant_decides_optimize_and_model() -> None:
    base = from_dict(JobConfig, {"model": "mlp"})
    assert not base.runs_optimize and base.model_name == "mlp"
    opt = from_dict(JobConfig, {"model": "mlp", "variant": "optimized"})
    assert opt.runs_optimize
    assert not from_dict(
        JobConfig, {"model": "mlp", "variant": "optimized", "optimize": False}
    ).runs_optimize
    hand = from_dict(JobConfig, {"model": "mlp", "variant": "hand", "hand_model": "cnn"})
    assert hand.model_name == "cnn" and not hand.runs_optimize


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"model": "mlp", "stepz": 3}, "stepz: unknown key"),
        ({"model": "mlp", "steps": "many"}, "steps: expected an integer, got 'many'"),
        ({"model": "mlp", "steps": 0}, "steps: expected an integer >= 1, got 0"),
        ({"model": "mlp", "lr": 0.1}, "lr: unknown key"),  # one name per thing: optim.lr
        ({"model": "mlp", "optim": {"lr": -1}}, "optim.lr: expected a number > 0, got -1.0"),
        ({"model": "mlp", "optim": {"name": "adamx"}}, "optim.name: unknown optimizer 'adamx'"),
        ({"model": "mlp", "device": "tpu"}, "device: expected one of 'auto', 'cpu', 'cuda'"),
        ({"model": "mlp", "precision": "fp16"}, "precision: expected one of 'fp32', 'bf16'"),
        (
            {"model": "mlp", "eval": {"every": 5}},
            "eval.every: expected 0 without held-out data (set data.holdout_fraction or "
            "data.eval_path), got 5",
        ),
        ({"model": "mlp", "data": {"source": "criteo"}}, "data.path: expected a file for source"),
        ({"model": "mlp", "variant": "fast"}, "variant: expected one of"),
        ({"model": "mlp", "parallel": "tp"}, "parallel: expected one of"),
        (
            {"model": "mlp", "variant": "hand"},
            "hand_model: expected a model name when variant is 'hand'",
        ),
        ({"model": "mlp", "run_id": "a/b"}, "run_id: expected a non-empty name without '/'"),
        ({"model": "mlp", "ps": {"latency_ms": -1}}, "ps.latency_ms: expected a number >= 0"),
        ({"model": "mlp", "ps": {"bogus": 1}}, "ps.bogus: unknown key"),
        ({"model": "mlp", "keep_checkpoints": -1}, "keep_checkpoints: expected an integer >= 0"),
        ({"model": "mlp", "deterministic": "yes"}, "deterministic: expected"),
        (
            {"model": "mlp", "ps": {"trainer_timeout_s": 0}},
            "ps.trainer_timeout_s: expected a number > 0, got 0",
        ),
        ({"steps": 3}, "JobConfig"),
        (
            {"model": "mlp", "pipeline": {"staleness": 2, "max_staleness": 1}},
            "pipeline.max_staleness: expected an integer >= max(1, pipeline.staleness = 2), or "
            "null, got 1",
        ),
        (
            {
                "model": "mlp",
                "deterministic": True,
                "pipeline": {"staleness": 1, "max_staleness": 3},
            },
            "pipeline.max_staleness: expected null unless pipeline.staleness >= 1 and "
            "deterministic is false",
        ),
    ],
)
def test_invalid_config_names_the_key(data: dict, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        from_dict(JobConfig, data)
    assert message in str(info.value) and "\n" not in str(info.value)


def test_a_process_that_sees_the_launching_run_dir_writes_there(tmp_path: Path) -> None:
    """Ray runs a job in its copy of the workspace; ``distopt launch`` names its own run dir
    (``DISTOPT_LAUNCH_RUN_DIR``), which a process on the same host (or a shared filesystem)
    takes when it holds the very job.yaml that process was given."""
    from distopt.training.config import launched_output_dir

    text = "model: mlp\nrun_id: r1\noutput_dir: runs\n"
    launched = tmp_path / "here" / "runs" / "r1"
    launched.mkdir(parents=True)
    (launched / "job.yaml").write_text(text)
    copy = tmp_path / "ray_pkg" / "runs" / "r1" / "job.yaml"  # Ray's copy of the workspace
    copy.parent.mkdir(parents=True)
    copy.write_text(text)
    config = load_config(JobConfig, copy)
    moved = launched_output_dir(config, copy, str(launched))
    assert moved.output_dir == str(tmp_path / "here" / "runs") and moved.run_id == "r1"
    # Not this run's directory (another config there, another run id, none there): unchanged.
    (launched / "job.yaml").write_text(text.replace("mlp", "cnn"))
    assert launched_output_dir(config, copy, str(launched)) is config
    assert launched_output_dir(config, copy, str(tmp_path / "here" / "runs" / "r2")) is config
    assert launched_output_dir(config, copy, str(tmp_path / "elsewhere" / "r1")) is config
    assert launched_output_dir(config, copy, None) is config
