"""examples/dlrm_criteo.py, run as its docstring says: the acceptance check of a launched DLRM job
with parameter servers (2 trainers, 1 server, local_cwd) on a generated Criteo-format click log."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path
from types import ModuleType

import pytest

from distopt.metrics import compare_runs, load_run
from tests.examples.scripts import run_documented

ROOT = Path(__file__).resolve().parents[2]


def load_example(relative: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(Path(relative).stem, ROOT / relative)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_launched_dlrm_learns_and_variants_match(tmp_path: Path) -> None:
    proc = run_documented(
        "python",
        "examples/dlrm_criteo.py",
        "--samples",
        "12000",
        "--steps",
        "80",
        "--out",
        tmp_path,
    )
    auc = {v: float(a) for v, a in re.findall(r"(\w+): held-out AUC (\d\.\d+)", proc.stdout)}
    assert auc["baseline"] >= 0.75 and auc["optimized"] == auc["baseline"]
    assert "gain [95% CI]" in proc.stdout  # distopt compare's table
    runs = [load_run(tmp_path / "dlrm-baseline"), load_run(tmp_path / "dlrm-optimized")]
    for rank in (0, 1):  # deterministic: true — the same loss at every step on every trainer
        losses = [[s.loss for s in run.ranks[rank].steps] for run in runs]
        assert len(losses[0]) == 80 and losses[0] == losses[1]
    assert [e.step for e in runs[0].ranks[0].evals] == [40, 80]
    assert all(s.wait_s is not None and s.lr == 0.003 for s in runs[0].ranks[0].steps)
    result = compare_runs(runs, warmup=3)
    assert result.config_diff == {} and result.gains[0].median > 0
    assert (tmp_path / "dlrm-baseline" / "tensorboard").is_dir()
