"""The trainer with real data: optimizer, schedule, accumulation, evaluation, exact resume."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from distopt.config import from_dict
from distopt.data.generate import unigram_entropy, write_tokens
from distopt.dist.env import JobEnv
from distopt.metrics import load_run
from distopt.training.config import JobConfig
from distopt.training.trainer import train

ROOT = Path(__file__).resolve().parents[2]
GPT = {"vocab_size": 64, "dim": 32, "heads": 2, "layers": 1, "seq_len": 16, "dropout": 0.1}


@pytest.fixture(scope="module")
def tokens(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tokens(
        tmp_path_factory.mktemp("data") / "tokens.bin", num_tokens=20_000, vocab_size=64, seed=0
    )


def _config(tokens: Path, out: Path, run_id: str, **overrides: object) -> JobConfig:
    data = {
        "model": "gpt", "model_kwargs": GPT, "steps": 12, "batch_size": 8, "seed": 0,
        "data": {"source": "tokens", "path": str(tokens), "holdout_fraction": 0.1},
        "optim": {"name": "adamw", "lr": 0.01, "accumulate_steps": 2, "clip_grad_norm": 1.0,
                  "schedule": {"warmup_steps": 3, "decay": "cosine"}},
        "eval": {"every": 6, "batch_size": 32, "max_batches": 4},
        "checkpoint_every": 6, "output_dir": str(out), "run_id": run_id, "tensorboard": False,
        **overrides,
    }  # fmt: skip
    return from_dict(JobConfig, data)


def test_resume_gives_the_same_losses_lr_and_evaluations(tokens: Path, tmp_path: Path) -> None:
    whole = train(_config(tokens, tmp_path, "whole"), JobEnv())
    assert whole.steps == 12 and whole.evaluation is not None
    # Resume another run from the uninterrupted run's checkpoint after 6 steps.
    (tmp_path / "part" / "checkpoints").mkdir(parents=True)
    shutil.copytree(
        tmp_path / "whole/checkpoints/step-00000006", tmp_path / "part/checkpoints/step-00000006"
    )
    part = train(_config(tokens, tmp_path, "part", resume=True), JobEnv())
    assert part.resumed_from == 6 and part.steps == 6
    a, b = load_run(tmp_path / "whole").ranks[0], load_run(tmp_path / "part").ranks[0]
    assert [s.step for s in b.steps] == list(range(6, 12))
    assert [(s.loss, s.lr) for s in a.steps[6:]] == [(s.loss, s.lr) for s in b.steps]
    assert a.evals[-1].metrics == b.evals[-1].metrics and a.evals[-1].step == 12
    assert a.steps[0].lr == pytest.approx(0.01 / 3)  # warm-up
    assert load_run(tmp_path / "whole").header["global_batch_size"] == 16  # 8 × 2 micro-batches


def test_synthetic_data_and_the_model_loss(tmp_path: Path) -> None:
    config = from_dict(
        JobConfig,
        {
            "model": "mlp",
            "steps": 3,
            "output_dir": str(tmp_path),
            "run_id": "s",
            "tensorboard": False,
            "data": {"synthetic_batches": 2},
        },
    )
    result = train(config, JobEnv())
    assert result.evaluation is None and result.final_loss > 0
    steps = load_run(tmp_path / "s").ranks[0].steps
    assert [s.wait_s for s in steps] == [None] * 3 and all(s.lr == 0.01 for s in steps)


def _torchrun(config: Path, *sets: str) -> subprocess.CompletedProcess[str]:
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        "-m",
        "distopt.train",
        "--config",
        str(config),
        *[a for s in sets for a in ("--set", s)],
    ]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)


@pytest.mark.slow
def test_gpt_fsdp2_bf16_learns_and_resumes_exactly(tokens: Path, tmp_path: Path) -> None:
    config = ROOT / "configs" / "jobs" / "gpt_tokens.yaml"
    common = (
        f"data.path={tokens}",
        f"output_dir={tmp_path}",
        "steps=40",
        "eval.every=20",
        "checkpoint_every=20",
        "tensorboard=false",
    )
    done = _torchrun(config, *common, "run_id=whole")
    assert done.returncode == 0, done.stderr[-3000:]
    (tmp_path / "part" / "checkpoints").mkdir(parents=True)
    shutil.copytree(
        tmp_path / "whole/checkpoints/step-00000020", tmp_path / "part/checkpoints/step-00000020"
    )
    done = _torchrun(config, *common, "run_id=part", "resume=true")
    assert done.returncode == 0, done.stderr[-3000:]
    whole, part = load_run(tmp_path / "whole"), load_run(tmp_path / "part")
    for rank in (0, 1):
        expected = [s.loss for s in whole.ranks[rank].steps[20:]]
        assert len(expected) == 20 and [s.loss for s in part.ranks[rank].steps] == expected
    final = whole.ranks[0].evals[-1].metrics["eval_loss"]
    assert part.ranks[0].evals[-1].metrics["eval_loss"] == final
    assert final < unigram_entropy(tokens) - 1.0, final
