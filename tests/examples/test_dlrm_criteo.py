"""examples/dlrm_criteo.py, small: the acceptance check of a launched DLRM job with parameter
servers (2 trainers, 1 server, local_cwd) on a generated Criteo-format click log."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import pytest

from distopt.metrics import compare_runs, load_run

ROOT = Path(__file__).resolve().parents[2]


def load_example(relative: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(Path(relative).stem, ROOT / relative)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_launched_dlrm_learns_and_variants_match(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)  # local_cwd runs the job where it is launched: the repository
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    auc = load_example("examples/dlrm_criteo.py").run(samples=12_000, steps=80, out=tmp_path)
    assert auc["baseline"] >= 0.75 and auc["optimized"] == auc["baseline"]
    runs = [load_run(tmp_path / "dlrm-baseline"), load_run(tmp_path / "dlrm-optimized")]
    for rank in (0, 1):  # deterministic: true — the same loss at every step on every trainer
        losses = [[s.loss for s in run.ranks[rank].steps] for run in runs]
        assert len(losses[0]) == 80 and losses[0] == losses[1]
    assert [e.step for e in runs[0].ranks[0].evals] == [40, 80]
    assert all(s.wait_s is not None and s.lr == 0.003 for s in runs[0].ranks[0].steps)
    result = compare_runs(runs, warmup=3)
    assert result.config_diff == {} and result.gains[0].median > 0
    assert (tmp_path / "dlrm-baseline" / "tensorboard").is_dir()
