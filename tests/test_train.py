"""``python -m distopt.train``: single process, resume, variants, bad input, 2-rank DDP, PS job."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from distopt.estimate.step import LOGGED, OTHER, PHASES, REPORTED
from distopt.metrics.compare import compare_runs
from distopt.metrics.qps_log import load_run
from distopt.train import main
from distopt.training.checkpoint import latest_complete
from distopt.training.config import JobConfig
from distopt.training.state import read_tensors
from tests.conftest import free_port

ROOT = Path(__file__).resolve().parents[1]
MLP = str(ROOT / "configs" / "jobs" / "mlp.yaml")
DLRM_TINY = ROOT / "configs" / "jobs" / "ps_dlrm_tiny.yaml"
TRAINER_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "DISTOPT_ROLE",
               "DISTOPT_NUM_PS", "DISTOPT_NUM_TRAINERS", "REPLICA_ID", "DISTOPT_RUN_ID",
               "DISTOPT_PS_ADDR", "DISTOPT_DDP_PORT", "TORCHELASTIC_USE_AGENT_STORE")  # fmt: skip


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in TRAINER_ENV:
        monkeypatch.delenv(name, raising=False)


def _base_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in TRAINER_ENV}
    env["OMP_NUM_THREADS"] = "1"  # several processes share two cores
    # tests.training.remote_model is importable by the job; what the caller's path adds stays.
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    return env


def test_single_process_job_writes_valid_log_and_checkpoints(tmp_path: Path) -> None:
    sets = [
        f"output_dir={tmp_path}",
        "run_id=smoke",
        "steps=8",
        "checkpoint_every=4",
        "batch_size=16",
    ]
    assert main(["--config", MLP, *[a for s in sets for a in ("--set", s)]]) == 0
    run = load_run(tmp_path / "smoke")
    assert run.variant == "baseline" and run.world_size == 1
    assert run.config["run_id"] == "smoke" and run.config["model"] == "mlp"
    assert run.header["global_batch_size"] == 16
    steps = run.ranks[0].steps
    assert [s.step for s in steps] == list(range(8))
    assert all(s.step_time_s > 0 and s.qps == pytest.approx(16 / s.step_time_s) for s in steps)
    assert run.ranks[0].footer is not None and run.ranks[0].footer["status"] == "ok"
    ckpt_dir = tmp_path / "smoke" / "checkpoints"
    assert sorted(p.name for p in ckpt_dir.iterdir()) == ["step-00000004", "step-00000008"]
    found = latest_complete(ckpt_dir)
    assert found is not None and found.step == 8 and found.job["run_id"] == "smoke"
    tensors = read_tensors(found)
    assert {k.removeprefix("dense/model/") for k in tensors if k.startswith("dense/model/")} == {
        n for n, _ in _mlp_named_tensors()
    }

    # Resume: continue the same run from step 8 to 12.
    more = [*sets[:3], "steps=12", "checkpoint_every=4", "batch_size=16", "resume=true"]
    assert main(["--config", MLP, *[a for s in more for a in ("--set", s)]]) == 0
    resumed = load_run(tmp_path / "smoke")
    assert [s.step for s in resumed.ranks[0].steps] == [8, 9, 10, 11]
    assert latest_complete(ckpt_dir).path == ckpt_dir / "step-00000012"  # type: ignore[union-attr]


def _mlp_named_tensors() -> list[tuple[str, torch.Tensor]]:
    from distopt import models
    from distopt.config import load_config
    from distopt.training.config import JobConfig

    config = load_config(JobConfig, MLP)
    return list(models.build(config.model, **config.model_kwargs).state_dict().items())


def test_baseline_and_optimized_runs_compare(tmp_path: Path) -> None:
    for variant in ("baseline", "optimized"):
        sets = [f"output_dir={tmp_path}", f"run_id={variant}", "steps=12", f"variant={variant}"]
        assert main(["--config", MLP, *[a for s in sets for a in ("--set", s)]]) == 0
    runs = [load_run(tmp_path / "baseline"), load_run(tmp_path / "optimized")]
    assert runs[1].variant == "optimized"
    result = compare_runs(runs, warmup=2)  # configs differ only in variant and run id
    assert result.config_diff == {} and result.gains[0].median > 0


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--set", "stepz=3"], "stepz: unknown key"),
        (["--set", "steps=-1"], "steps: expected an integer >= 1, got -1"),
        (["--set", "model=nope"], "model: unknown model 'nope'"),
        (["--set", "model=mypkg.recmodel.make_ranker"],
         "; your own factory is named 'module:function', e.g. 'mypkg.recmodel:make_ranker')"),
        (["--set", "model=tests.training.remote_model:remote_mlp", "--set", "model_kwargs={}"],
         "model: 'tests.training.remote_model:remote_mlp' has parameter-server tables "
         "(ps_tables()), and this process has no servers: launch the job with `distopt launch`"),
        (
            ["--set", "model_kwargs={width: 3}"],
            "model_kwargs: got an unexpected keyword argument 'width'",
        ),
        (["--set", "pipeline={enabled: true, staleness: -1}"],
         "pipeline.staleness: expected an integer >= 0, got -1"),
        (["--set", "pipeline.staleness=1.5"], "pipeline.staleness: expected an integer, got 1.5"),
        (["--set", "pipeline.enabled=true"],
         "pipeline.enabled: expected false unless the model is optimized (variant 'baseline' runs it "
         "as written), got True"),
        (["--set", "variant=optimized", "--set", "pipeline.enabled=true"],
         "pipeline: model MLP has no remote read; nothing to prefetch"),
    ],
)  # fmt: skip
def test_bad_config_is_a_one_line_error(
    tmp_path: Path, args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["--config", MLP, "--set", f"output_dir={tmp_path}", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("distopt.train: error: ") and message in err and "\n" not in err


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("stpes=5", "stpes: unknown key (known keys: {known})"),
        ("steps=abc", "steps: expected an integer, got 'abc'"),
        ("model_kwargs.sizes=[8,4",
         "model_kwargs.sizes: cannot parse '[8,4' as YAML (expected ',' or ']', but got '<stream end>')"),
    ],
)  # fmt: skip
def test_overrides_fail_with_the_components_messages(
    override: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """The same one-line messages as ``torchx run ... distopt.ps_job --set`` (after its ``--set: ``)."""
    known = ", ".join(sorted(f.name for f in dataclasses.fields(JobConfig)))
    assert main(["--config", str(DLRM_TINY), "--set", override]) == 2
    assert capsys.readouterr().err == f"distopt.train: error: {message.format(known=known)}\n"


def test_missing_config_file_exits_2(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "distopt.train", "--config", str(tmp_path / "nope.yaml")],
        capture_output=True, text=True, timeout=60, env=_base_env(),
    )  # fmt: skip
    assert proc.returncode == 2
    assert (
        proc.stderr.strip()
        == f"distopt.train: error: config file not found: {tmp_path / 'nope.yaml'}"
    )


def _wait_all(
    procs: dict[str, subprocess.Popen[str]], timeout_s: float
) -> dict[str, tuple[int, str]]:
    """Wait for every process; kill (by PID) whatever outlives the deadline, then fail."""
    deadline = time.monotonic() + timeout_s
    results = {}
    try:
        for name, proc in procs.items():
            out, _ = proc.communicate(timeout=max(0.1, deadline - time.monotonic()))
            results[name] = (proc.returncode, out)
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return results


@pytest.mark.slow
def test_two_rank_ddp_with_torchrun(tmp_path: Path) -> None:
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
        "-m", "distopt.train", "--config", str(ROOT / "configs" / "jobs" / "mlp_ddp.yaml"),
        "--set", f"output_dir={tmp_path}", "--set", "steps=10", "--set", "checkpoint_every=5",
    ]  # fmt: skip
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_base_env()
    )
    ((rc, out),) = _wait_all({"torchrun": proc}, 60).values()
    assert rc == 0, out
    (run_dir,) = tmp_path.iterdir()  # both ranks agreed on the run id chosen by rank 0
    run = load_run(run_dir)
    assert sorted(run.ranks) == [0, 1] and run.world_size == 2
    assert run.header["global_batch_size"] == 2 * run.config["batch_size"]
    assert [m.step for m in run.merged_steps()] == list(range(10))
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == [
        "step-00000005", "step-00000010",
    ]  # fmt: skip
    found = latest_complete(run_dir / "checkpoints")
    assert found is not None and sorted(found.manifest["files"]) == [
        "dense/.metadata",
        "dense/__0_0.distcp",
        "dense/__1_0.distcp",
        "rank0.pt",
        "rank1.pt",
    ]  # fmt: skip  -- one dense copy for both DDP ranks, one RNG file per rank


def _run_with_servers(
    tmp_path: Path, *, config: str | Path, num_trainers: int = 2, sets: tuple[str, ...] = ()
) -> dict[str, tuple[int, str]]:
    """Run 1 server and ``num_trainers`` trainers with the environment of the TorchX ``ps_job``."""
    port, ddp_port = free_port(), free_port()
    common = {
        **_base_env(), "DISTOPT_NUM_PS": "1", "DISTOPT_NUM_TRAINERS": str(num_trainers),
        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "DISTOPT_PS_ADDR": f"127.0.0.1:{port}",
        "DISTOPT_DDP_PORT": str(ddp_port),
    }  # fmt: skip
    args = [a for s in (f"output_dir={tmp_path}", *sets) for a in ("--set", s)]
    procs = {}
    for role, replica in [("ps", 0)] + [("trainer", r) for r in range(num_trainers)]:
        env = {**common, "DISTOPT_ROLE": role, "REPLICA_ID": str(replica)}
        procs[f"{role}{replica}"] = subprocess.Popen(
            [sys.executable, "-m", "distopt.train", "--config", str(config), *args],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
        )  # fmt: skip
    return _wait_all(procs, 90)


def _assert_ok(results: dict[str, tuple[int, str]]) -> None:
    # Every failed process's output: a server that timed out waiting for a crashed trainer is
    # only the symptom; the trainer's own stack names the cause.
    failed = [f"{name} exited {rc}:\n{out}" for name, (rc, out) in results.items() if rc != 0]
    assert not failed, "\n".join(failed)
    assert "all trainers finished" in results["ps0"][1]


@pytest.mark.slow
def test_ps_dlrm_job_one_server_two_ddp_trainers(tmp_path: Path) -> None:
    _assert_ok(
        _run_with_servers(tmp_path, config=DLRM_TINY, sets=("run_id=ps", "checkpoint_every=10"))
    )
    run = load_run(tmp_path / "ps")
    assert sorted(run.ranks) == [0, 1] and run.header["num_ps"] == 1
    assert run.header["ps_latency_ms"] == 1.0 and run.config["model"] == "dlrm"
    assert [m.step for m in run.merged_steps()] == list(range(20))
    found = latest_complete(tmp_path / "ps" / "checkpoints")
    assert found is not None and found.step == 20 and found.job["num_ps"] == 1
    tables = {k for k in read_tensors(found) if k.startswith("ps0/")}  # the server wrote its shards
    assert tables == {"ps0/emb0/weight", "ps0/emb1/weight"}


@pytest.mark.slow
def test_two_trainers_rehearse_the_optimized_step_together(tmp_path: Path) -> None:
    """Issue 24: the trainers of a deterministic DDP job rehearse as they train: the predicted
    all-reduce is measured (not modelled) and the pushes are their turns, barriers included."""
    sets = ("run_id=opt", "variant=optimized", "deterministic=true")
    _assert_ok(_run_with_servers(tmp_path, config=DLRM_TINY, sets=sets))
    run = load_run(tmp_path / "opt")
    for rank in (0, 1):
        phases = run.ranks[rank].header["predicted_phases"]
        how = phases["how"]
        assert "the 2 trainers in step" in how["forward"]
        assert how["pushes"].startswith("the trainers push one after the other")
        assert "dense gradient bytes in one call" in how["all_reduce"]
        # The synthetic loader has no workers: each step reads its batch, timed at start-up.
        assert "the loader reads in the trainer's process (no workers)" in how["data"]
        for schedule in ("baseline", "optimized"):
            assert phases[schedule]["data"] > 0
            assert 0 < phases[schedule]["all_reduce"] <= phases[schedule]["backward"]
            # Each turn waits out a push of at least the injected millisecond, then a barrier.
            assert phases[schedule]["pushes"] >= 2 * 0.001


@pytest.mark.slow
def test_a_failure_in_the_rehearsal_says_so(tmp_path: Path) -> None:
    """A user's trial: a model that raised on its 25th call failed an optimized job before its
    first step, with nothing saying that distopt was rehearsing steps then."""
    config = tmp_path / "job.yaml"
    config.write_text(
        "model: 'tests.training.remote_model:remote_mlp'\nmodel_kwargs: {fail_after: 30}\n"
        "steps: 12\nvariant: optimized\n"
        "ps: {rpc_timeout_s: 20, start_timeout_s: 30, join_timeout_s: 60}\n"
    )
    rc, out = _run_with_servers(tmp_path, config=config, num_trainers=1)["trainer0"]
    assert rc == 1
    assert (
        "RuntimeError: the optimized variant's start-up rehearsal (training steps "
        "on the first batches, timed to predict the gain: docs/cost_model.md) failed: RuntimeError: "
        "injected failure in forward call 31"
    ) in out, out[-3000:]


@pytest.mark.slow
def test_ps_dlrm_optimized_and_hand_variants_compare(tmp_path: Path) -> None:
    for variant in ("optimized", "hand"):
        sets = (f"run_id={variant}", f"variant={variant}", "parallel=none")
        _assert_ok(_run_with_servers(tmp_path, config=DLRM_TINY, num_trainers=1, sets=sets))
    runs = [load_run(tmp_path / "optimized"), load_run(tmp_path / "hand")]
    assert [r.variant for r in runs] == ["optimized", "hand"]
    predicted = (
        "predicted_gain",
        "predicted_step_time_s",
        "predicted_saving_s",
        "predicted_rpc_latency_s",
        "predicted_phases",
    )
    assert [k for k in runs[0].header if k.startswith("predicted_")] == list(predicted)
    assert not any(k.startswith("predicted_") for k in runs[1].header)  # hand-written: no graph
    # Every step of both variants records its phases; they are disjoint parts of its time.
    for run in runs:
        for record in run.ranks[0].steps:
            assert record.phases is not None and list(record.phases) == list(LOGGED)
            assert sum(record.phases[p] for p in PHASES) <= record.step_time_s
            assert record.phases["waits"] <= record.phases["forward"]
            assert record.wait_s is not None and record.phases["waits"] <= record.wait_s + 1e-9
    phases = runs[0].header["predicted_phases"]
    assert list(phases["optimized"]) == list(REPORTED) == list(phases["baseline"])
    assert runs[0].header["predicted_step_time_s"] == pytest.approx(
        sum(phases["optimized"][p] for p in (*PHASES, OTHER))
    )
    assert phases["optimized"]["all_reduce"] == 0.0  # one trainer, no DDP
    result = compare_runs(runs, warmup=2)
    assert result.config_diff == {} and result.gains[0].median > 0
    against_hand = compare_runs(runs[::-1], warmup=2)  # the hand run as the baseline
    assert [row.phase for row in against_hand.phases] == [*REPORTED, "step"]
    assert all(
        row.measured is not None and row.baseline_measured is not None
        for row in against_hand.phases
    )


@pytest.mark.slow
def test_ps_job_fails_fast_when_a_trainer_fails(tmp_path: Path) -> None:
    config = tmp_path / "job.yaml"
    config.write_text(
        "model: 'tests.training.remote_model:remote_mlp'\nmodel_kwargs: {fail_after: 4}\nsteps: 12\n"
        "ps: {rpc_timeout_s: 20, start_timeout_s: 30, join_timeout_s: 60}\n"
    )
    start = time.monotonic()
    results = _run_with_servers(tmp_path, config=config, num_trainers=1)
    assert time.monotonic() - start < 60
    assert (
        results["trainer0"][0] == 1
        and "injected failure in forward call 5" in results["trainer0"][1]
    )
    rc, out = results["ps0"]
    assert rc == 1 and "parameter server aborting: trainer 0 failed" in out
