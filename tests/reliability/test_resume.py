"""Resume is exact, and never from an incomplete checkpoint."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from distopt.metrics.qps_log import load_run
from distopt.train import main
from distopt.training.checkpoint import MANIFEST, latest_complete, step_dir
from distopt.training.state import read_tensors
from tests.reliability.jobs import JOB_ENV, ROOT, assert_same_tensors, job_env

MLP = str(ROOT / "configs" / "jobs" / "mlp.yaml")


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in JOB_ENV:  # the in-process job reads its place from the environment
        monkeypatch.delenv(name, raising=False)


MLP_DDP = str(ROOT / "configs" / "jobs" / "mlp_ddp.yaml")


def _train(out: Path, run_id: str, *sets: str) -> None:
    args = [f"output_dir={out}", f"run_id={run_id}", "checkpoint_every=4", "batch_size=16", *sets]
    assert main(["--config", MLP, *[a for s in args for a in ("--set", s)]]) == 0


def test_resume_skips_incomplete_checkpoints_and_matches_an_uninterrupted_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    _train(tmp_path, "reference", "steps=12")
    _train(tmp_path, "run", "steps=8")  # complete checkpoints at steps 4 and 8
    root = tmp_path / "run" / "checkpoints"
    # A job killed while writing step 8's dense state: the file is shorter than the manifest says.
    shard = next((step_dir(root, 8) / "dense").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:-7])
    # A job killed while cutting step 12: some files, no manifest.
    partial = step_dir(root, 12)
    partial.mkdir()
    (partial / "rank0.pt").write_bytes(b"half a checkpoint")
    capsys.readouterr()

    # Restarted by torchrun (--max-restarts): resumes without resume=true in the config.
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    _train(tmp_path, "run", "steps=12")
    err = capsys.readouterr().err
    assert f"ignoring incomplete checkpoint {partial}: no {MANIFEST}" in err
    assert f"ignoring incomplete checkpoint {step_dir(root, 8)}: dense/{shard.name} has" in err
    steps = [s.step for s in load_run(tmp_path / "run").ranks[0].steps]
    assert steps == list(range(4, 12))  # resumed from step 4, the newest complete checkpoint
    found = latest_complete(root)
    assert found is not None and found.path == partial  # rewritten, complete this time
    reference = latest_complete(tmp_path / "reference" / "checkpoints")
    assert reference is not None
    assert_same_tensors(read_tensors(found), read_tensors(reference))


@pytest.mark.slow
def test_fsdp_resume_through_sharded_dcp_checkpoint_is_exact(tmp_path: Path) -> None:
    """Two FSDP ranks: 6 steps straight, and 3 steps then a resumed run to 6, end equal."""

    def torchrun(run_id: str, *sets: str) -> None:
        args = [f"output_dir={tmp_path}", f"run_id={run_id}", "parallel=fsdp", "checkpoint_every=3",
                *sets]  # fmt: skip
        cmd = [
            sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
            "-m", "distopt.train", "--config", MLP_DDP, *[a for s in args for a in ("--set", s)],
        ]  # fmt: skip
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=80, env=job_env())
        assert proc.returncode == 0, proc.stdout + proc.stderr

    torchrun("reference", "steps=6")
    torchrun("run", "steps=3")
    torchrun("run", "steps=6", "resume=true")
    got = latest_complete(tmp_path / "run" / "checkpoints")
    want = latest_complete(tmp_path / "reference" / "checkpoints")
    assert got is not None and want is not None and got.step == want.step == 6
    # Each rank wrote its own shard of the one dense state.
    assert {f for f in got.manifest["files"] if f.endswith(".distcp")} == {
        "dense/__0_0.distcp", "dense/__1_0.distcp",
    }  # fmt: skip
    assert_same_tensors(read_tensors(got), read_tensors(want))
