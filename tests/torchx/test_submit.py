"""``distopt.launch`` and ``distopt launch``: bad input is a one-line error before anything is
scheduled (nothing written, no TorchX call); a dry run builds the component's request."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import distopt
from distopt.cli import main as cli
from distopt.data.generate import write_criteo
from distopt.dist.rendezvous import run_port
from distopt.errors import ConfigError
from distopt.torchx.submit import COMPONENTS, Launched
from distopt.training.device import NO_GPU
from tests.torchx.release import dryrun_app, slurm_options

ROOT = Path(__file__).resolve().parents[2]
DLRM = ROOT / "configs" / "jobs" / "dlrm_criteo.yaml"


@pytest.fixture(scope="module")
def clicks(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_criteo(tmp_path_factory.mktemp("data") / "clicks.tsv", num_samples=1200, seed=0)


def _launch(tmp_path: Path, *overrides: str, scheduler: str = "local_cwd", **cfg: object):
    sets = [f"output_dir={tmp_path / 'runs'}", *overrides]
    return distopt.launch(DLRM, scheduler, overrides=sets, run_id="r", **cfg)


def _refused(tmp_path: Path, *overrides: str, **kwargs: object) -> str:
    with pytest.raises(ConfigError) as info:
        _launch(tmp_path, *overrides, **kwargs)
    assert not (tmp_path / "runs").exists()  # nothing written, so nothing was scheduled
    message = str(info.value)
    assert "\n" not in message
    return message


def test_a_data_factory_that_does_not_import(tmp_path: Path) -> None:
    message = _refused(tmp_path, "data={source: 'nowhere.data:make', task: click}")
    assert message == (
        "data.source: cannot import 'nowhere.data:make' "
        "(ModuleNotFoundError: No module named 'nowhere')"
    )


def test_a_missing_data_file(tmp_path: Path) -> None:
    missing = tmp_path / "nope.tsv"
    assert _refused(tmp_path, f"data.path={missing}") == f"data.path: file not found: {missing}"


def test_a_malformed_data_file_names_the_line(tmp_path: Path, clicks: Path) -> None:
    bad = tmp_path / "bad.tsv"
    lines = clicks.read_text().splitlines(keepends=True)
    bad.write_text("".join(lines[:2]) + "1\t2\t3\n" + "".join(lines[2:5]))
    assert _refused(tmp_path, f"data.path={bad}") == (
        f"data.path: {bad}:3: expected 40 tab-separated fields, got 3"
    )


def test_an_unknown_optimizer(tmp_path: Path, clicks: Path) -> None:
    message = _refused(tmp_path, f"data.path={clicks}", "optim.name=adamx")
    assert message.startswith("optim.name: unknown optimizer 'adamx' (known: adadelta, adafactor")
    assert "adamw" in message and "sgd" in message


def test_an_optimizer_argument_it_does_not_take(tmp_path: Path, clicks: Path) -> None:
    message = _refused(tmp_path, f"data.path={clicks}", "optim.kwargs={momentum: 0.9}")
    assert message.startswith(
        "optim.kwargs.momentum: Adam takes no argument 'momentum' (accepted: "
    )


@pytest.mark.skipif(torch.cuda.is_available(), reason="this host has a GPU")
def test_device_cuda_without_a_gpu(tmp_path: Path, clicks: Path) -> None:
    assert _refused(tmp_path, f"data.path={clicks}", "device=cuda") == NO_GPU
    assert NO_GPU == (
        "device: 'cuda' requested but torch.cuda.is_available() is False on this "
        "host (no GPU, or a CPU-only build of torch); use device: cpu or auto"
    )


def test_unknown_scheduler_and_scheduler_option(tmp_path: Path, clicks: Path) -> None:
    assert _refused(tmp_path, f"data.path={clicks}", scheduler="nope").startswith(
        "scheduler: unknown TorchX scheduler 'nope' (known: "
    )
    # The options known differ between TorchX releases (torchx-nightly's Slurm has more).
    assert _refused(tmp_path, f"data.path={clicks}", scheduler="slurm", acount="ml").startswith(
        f"cfg.acount: not an option of the slurm scheduler (known: {slurm_options()})"
    )


def test_the_cli_prints_one_line_and_exits_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "nope.tsv"
    code = cli(
        [
            "launch",
            str(DLRM),
            "--set",
            f"data.path={missing}",
            "--set",
            f"output_dir={tmp_path / 'runs'}",
        ]
    )
    err = capsys.readouterr().err.strip()
    assert code == 2 and err == f"distopt launch: error: data.path: file not found: {missing}"


def test_dryrun_resolves_the_config_and_picks_the_component(tmp_path: Path, clicks: Path) -> None:
    with _launch(tmp_path, f"data.path={clicks}", "variant=optimized", dryrun=True) as job:
        assert job.handle is None and job.component == COMPONENTS["ps"] == "distopt.ps_job"
        assert job.args[:2] == ["--config", str(job.run_dir / "job.yaml")]
        assert job.args[2:] == ["--num_ps", "1", "--num_trainers", "2"]  # DLRM has ps_tables()
        roles = {role.name: role for role in dryrun_app(job.dryrun).roles}
        assert sorted(roles) == ["ps", "trainer"] and roles["trainer"].num_replicas == 2
    resolved = job.config
    assert resolved.run_id == "r" and resolved.variant == "optimized"
    assert resolved.data.path == str(clicks) and resolved.optim.name == "adam"
    assert not (tmp_path / "runs").exists()  # a dry run leaves nothing behind


def test_a_dryrun_keeps_an_earlier_runs_config(tmp_path: Path, clicks: Path) -> None:
    earlier = tmp_path / "runs" / "r" / "job.yaml"
    earlier.parent.mkdir(parents=True)
    earlier.write_text("# the config of an earlier run r\n")
    with _launch(tmp_path, f"data.path={clicks}", dryrun=True):
        pass
    assert earlier.read_text() == "# the config of an earlier run r\n"
    assert [p.name for p in earlier.parent.iterdir()] == ["job.yaml"]


def test_a_job_without_servers_uses_torchrun(tmp_path: Path) -> None:
    config = ROOT / "configs" / "jobs" / "mlp_ddp.yaml"
    with distopt.launch(
        config, overrides=[f"output_dir={tmp_path}"], num_trainers=3, dryrun=True
    ) as job:
        assert job.component == "distopt.spmd" and job.args[2:] == ["--nproc_per_node", "3"]


def test_device_cuda_asks_the_scheduler_for_one_gpu_per_trainer(
    tmp_path: Path, clicks: Path
) -> None:
    # Slurm: the GPU check is the cluster's, so this dry run works on a host without one.
    with _launch(
        tmp_path, f"data.path={clicks}", "device=cuda", scheduler="slurm", dryrun=True
    ) as job:
        # Last, the run's own ports and the run dir the replicas write to where they see it
        # (tests/user_jobs/test_ray_runs).
        assert job.args[-6:] == [
            "--gpu",
            "1",
            "--master_port",
            str(run_port("r")),
            "--env",
            _launch_run_dir(job),
        ]
        roles = {role.name: role for role in dryrun_app(job.dryrun).roles}
        assert (roles["ps"].resource.gpu, roles["trainer"].resource.gpu) == (0, 1)
    config = ROOT / "configs" / "jobs" / "gpt_tokens.yaml"
    sets = [f"output_dir={tmp_path}", "device=cuda", f"data.path={_tokens(tmp_path)}"]
    with distopt.launch(config, "slurm", overrides=sets, num_trainers=4, dryrun=True) as job:
        assert job.args[-6:-2] == ["--nproc_per_node", "4", "--gpu", "4"]
        assert job.args[-2:] == ["--env", _launch_run_dir(job)]
    with distopt.launch(
        config, "slurm", overrides=sets, component_args={"h": "gpu.small"}, dryrun=True
    ) as job:
        assert "--gpu" not in job.args and dryrun_app(job.dryrun).roles[0].resource.gpu == 1


def test_two_runs_on_a_cluster_take_ports_of_their_own(tmp_path: Path, clicks: Path) -> None:
    """Slurm and Ray place the first server where this host cannot look: each run takes ports
    of its own (two Slurm jobs on one node both took 29500, and the second job's server failed);
    a port the user chose stays."""
    ports = []
    for run_id in ("a", "b"):
        sets = [f"output_dir={tmp_path / 'runs'}", f"data.path={clicks}"]
        with distopt.launch(DLRM, "slurm", overrides=sets, run_id=run_id, dryrun=True) as job:
            envs = [role.env for role in dryrun_app(job.dryrun).roles]
        assert {env["MASTER_PORT"] for env in envs} == {str(run_port(run_id))}
        assert {env["DISTOPT_DDP_PORT"] for env in envs} == {str(run_port(run_id) + 1)}
        ports.append(run_port(run_id))
    assert ports[0] != ports[1]
    chosen = {"master_port": 4100}
    sets = [f"output_dir={tmp_path / 'runs'}", f"data.path={clicks}"]
    with distopt.launch(
        DLRM, "slurm", overrides=sets, run_id="a", component_args=chosen, dryrun=True
    ) as job:
        assert {role.env["MASTER_PORT"] for role in dryrun_app(job.dryrun).roles} == {"4100"}


def _launch_run_dir(job: Launched) -> str:
    return f"DISTOPT_LAUNCH_RUN_DIR={job.run_dir.resolve()}"


def _tokens(tmp_path: Path) -> Path:
    from distopt.data.generate import write_tokens

    return write_tokens(tmp_path / "tokens.bin", num_tokens=5000, vocab_size=64, seed=0)


def test_distopt_ray_on_any_torchx(
    tmp_path: Path, clicks: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`distopt launch -s distopt_ray` needs no TorchX registration (distopt.torchx.schedulers)."""
    pytest.importorskip("ray")
    code = cli(
        [
            "launch",
            str(DLRM),
            "-s",
            "distopt_ray",
            "--cfg",
            "dashboard_address=127.0.0.1:1",
            "--set",
            f"data.path={clicks}",
            "--set",
            f"output_dir={tmp_path / 'runs'}",
            "--dryrun",
        ]
    )
    out = capsys.readouterr().out
    assert code == 0 and '"dashboard_address": "127.0.0.1:1"' in out, out[-2000:]
    assert [line.split('"')[3] for line in out.splitlines() if '"role":' in line] == [
        "ps",
        "trainer",
        "trainer",
    ]
