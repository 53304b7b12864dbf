"""Components without a cluster: AppDef fields, dry runs per scheduler, argument validation."""

from __future__ import annotations

import dataclasses
import re
import shlex
from pathlib import Path
from typing import Any

import pytest
from torchx.runner import get_runner
from torchx.specs import AppDef

from distopt.errors import ConfigError
from distopt.torchx import components
from distopt.training.config import JobConfig
from tests.launchers.conftest import JOB_MODULE, REPO, job_config, torchx

TINY = "configs/jobs/ps_dlrm_tiny.yaml"
KNOWN = ", ".join(sorted(f.name for f in dataclasses.fields(JobConfig)))


@pytest.fixture
def config(tmp_path: Path) -> str:
    return str(job_config(tmp_path, model="mlp", steps=3))


def _script(app: AppDef, role: int = 0) -> str:
    assert app.roles[role].entrypoint == "bash" and app.roles[role].args[0] == "-c"
    return app.roles[role].args[1]


def test_ps_job_has_server_and_trainer_roles(config: str) -> None:
    app = components.ps_job(config, num_ps=2, num_trainers=3, set=["steps=5"], output_dir="/tmp/o")
    ps, trainer = app.roles
    assert (ps.name, ps.num_replicas, trainer.name, trainer.num_replicas) == ("ps", 2, "trainer", 3)
    for role in app.roles:
        assert role.env["DISTOPT_ROLE"] == role.name
        assert role.env["WORLD_SIZE"] == "5"
        assert role.env["DISTOPT_NUM_PS"] == "2" and role.env["DISTOPT_NUM_TRAINERS"] == "3"
        assert role.env["REPLICA_ID"] == "${replica_id}"
        assert role.env["DISTOPT_DDP_PORT"] == str(int(role.env["MASTER_PORT"]) + 1)
        # iface 'auto': each process picks the interface of its route toward MASTER_ADDR.
        assert "GLOO_SOCKET_IFNAME" not in role.env and "TP_SOCKET_IFNAME" not in role.env
    # Servers take RPC ranks 0..1, trainers 2..4.
    assert "RANK=$((0 + ${replica_id}))" in _script(app, 0)
    assert "RANK=$((2 + ${replica_id}))" in _script(app, 1)
    argv = shlex.split(_script(app, 1).split("exec ", 1)[1])
    assert argv[1:] == ["-m", "distopt.train", "--config", config,
                        "--set", "steps=5", "--set", "output_dir=/tmp/o"]  # fmt: skip


@pytest.mark.parametrize("where", ["config", "--set"])
def test_ps_job_on_ray_actors_has_the_trainer_role_only(tmp_path: Path, where: str) -> None:
    """ps.backend: ray: trainer 0 creates the server actors, so nothing schedules ps processes."""
    values: dict[str, Any] = {"model": "mlp", "steps": 3}
    overrides = ["ps.backend=ray"]
    if where == "config":
        values["ps"], overrides = {"backend": "ray"}, []
    config = str(job_config(tmp_path, **values))
    app = components.ps_job(config, num_ps=2, num_trainers=3, set=overrides)
    (trainer,) = app.roles
    assert (trainer.name, trainer.num_replicas) == ("trainer", 3)
    assert trainer.env["DISTOPT_NUM_PS"] == "2" and trainer.env["DISTOPT_NUM_TRAINERS"] == "3"
    assert trainer.env["WORLD_SIZE"] == "3" and trainer.env["DISTOPT_ROLE"] == "trainer"
    assert "RANK=$((0 + ${replica_id}))" in _script(
        app
    )  # trainer 0 is the first replica: MASTER_ADDR


def test_ps_job_master_address_comes_from_scheduler_rank0_variable(config: str) -> None:
    script = _script(components.ps_job(config))
    assert 'MASTER_ADDR="${MASTER_ADDR:-${${rank0_env}:-127.0.0.1}}"' in script
    assert components.ps_job(config, iface="").roles[0].env.get("GLOO_SOCKET_IFNAME") is None
    named = components.ps_job(config, iface="eth1").roles[0].env
    assert named["GLOO_SOCKET_IFNAME"] == named["TP_SOCKET_IFNAME"] == "eth1"


@pytest.mark.parametrize("component", [components.spmd])
def test_torchrun_components(component, config: str) -> None:
    app = component(config, nnodes=2, nproc_per_node=3, set=["model_kwargs.depth=1"])
    (role,) = app.roles
    assert role.num_replicas == 2 and role.env["DISTOPT_NUM_PS"] == "0"
    assert role.env["DISTOPT_LAUNCH"] == "spmd"
    script = _script(app)
    assert "-m torch.distributed.run" in script and "--nproc_per_node 3" in script
    assert '--rdzv_endpoint "${${rank0_env}:-127.0.0.1}":29500' in script
    assert script.endswith(f"-m distopt.train --config {config} --set model_kwargs.depth=1")
    single = _script(component(config, nnodes=1))
    assert "--rdzv_endpoint 127.0.0.1:0" in single


def _ray_replicas(request: Any) -> list[tuple[str, int, int]]:
    """(role, CPUs, GPUs) of each replica in a dry run of the `ray` scheduler: TorchX's own
    (torchx 0.7) or distopt's (TorchX without one, distopt.torchx.ray_scheduler)."""
    if hasattr(request, "actors"):
        return [(a.name, a.num_cpus, a.num_gpus) for a in request.actors]
    return [(r.role, int(r.resources["CPU"]), int(r.resources.get("GPU", 0)))
            for r in request.replicas]  # fmt: skip


def test_gpus_go_to_trainers_and_named_resources_replace_them(config: str) -> None:
    ps, trainer = components.ps_job(config, gpu=1, memMB=4096).roles
    assert (ps.resource.gpu, trainer.resource.gpu, trainer.resource.memMB) == (0, 1, 4096)
    (node,) = components.spmd(config, nproc_per_node=4, gpu=4).roles
    assert node.resource.gpu == 4
    named = components.spmd(config, h="gpu.small").roles[0].resource
    assert (named.gpu, named.cpu) == (1, 8)
    with get_runner() as runner:  # Slurm asks for the trainers' GPUs, not the servers'
        script = runner.dryrun_component(
            "distopt.ps_job", ["--config", config, "--gpu", "2"], "slurm", cfg={}
        ).request.materialize()
        assert script.count("--gpus-per-task=2") == 2 and script.count("--gpus-per-task") == 2
        pytest.importorskip("ray")
        replicas = _ray_replicas(runner.dryrun_component(
            "distopt.ps_job", ["--config", config, "--gpu", "1"], "ray",
            cfg={"dashboard_address": "127.0.0.1:1"},
        ).request)  # fmt: skip
    assert replicas == [("ps", 1, 0), ("trainer", 1, 1), ("trainer", 1, 1)]


@pytest.mark.parametrize(
    ("kwargs", "flag"),
    [
        ({"num_ps": 0}, "--num_ps"),
        ({"num_trainers": -1}, "--num_trainers"),
        ({"cpu": 0}, "--cpu"),
        ({"gpu": -1}, "--gpu"),
        ({"h": "gpu.enormous"}, "-h"),
        ({"master_port": 70000}, "--master_port"),
        ({"set": ["novalue"]}, "--set"),
        ({"set": ["=3"]}, "--set"),
    ],
)
def test_ps_job_bad_arguments_name_the_flag(config: str, kwargs: dict, flag: str) -> None:
    with pytest.raises(ConfigError) as err:
        components.ps_job(config, **kwargs)
    assert str(err.value).startswith(f"{flag}: ") and "\n" not in str(err.value)


def test_missing_and_malformed_config(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"^--config: config file not found: .*nope\.yaml$"):
        components.ps_job(str(tmp_path / "nope.yaml"))
    bad = tmp_path / "bad.yaml"
    bad.write_text("steps: [1\n")
    with pytest.raises(ConfigError, match=r"^--config: .*bad\.yaml:\d+: "):
        components.spmd(str(bad))
    with pytest.raises(ConfigError, match="^--nproc_per_node: "):
        components.spmd(str(tmp_path / "nope.yaml"), nproc_per_node=0)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["stpes=5"], f"--set: stpes: unknown key (known keys: {KNOWN})"),
        (["steps=abc"], "--set: steps: expected an integer, got 'abc'"),
        (["ps.latency_ms=[1"], "--set: ps.latency_ms: cannot parse '[1' as YAML "
                               "(expected ',' or ']', but got '<stream end>')"),
    ],
)  # fmt: skip
def test_merged_config_is_checked_before_scheduling(overrides: list[str], message: str) -> None:
    for component in (components.ps_job, components.spmd):
        with pytest.raises(ConfigError) as err:
            component(TINY, set=overrides)
        assert str(err.value) == message


def test_config_file_errors_name_the_file(tmp_path: Path) -> None:
    typo = job_config(tmp_path, model="mlp", stpes=5)
    with pytest.raises(ConfigError) as err:
        components.ps_job(str(typo))
    assert str(err.value) == f"--config: {typo}: stpes: unknown key (known keys: {KNOWN})"
    # A --set that fixes the file is fine; one that names no key of the file blames the file.
    no_model = job_config(tmp_path, steps=5)
    components.ps_job(str(no_model), set=["model=mlp"])
    with pytest.raises(ConfigError) as err:
        components.ps_job(str(no_model), set=["optim.lr=0.5"])
    assert str(err.value) == f"--config: {no_model}: model: missing (a required key of JobConfig)"


def test_list_values_survive_torchx_comma_split() -> None:
    # What TorchX hands the component for --set model_kwargs.sizes=[8,4],steps=5
    app = components.ps_job(TINY, set=["model_kwargs.sizes=[8", "4]", "steps=5"])
    argv = shlex.split(_script(app, 1).split("exec ", 1)[1])
    assert argv[-4:] == ["--set", "model_kwargs.sizes=[8,4]", "--set", "steps=5"]


def test_other_modules_bring_their_own_config(tmp_path: Path) -> None:
    """The JobConfig schema is distopt.train's; the rendezvous job has keys of its own."""
    config = str(job_config(tmp_path, fail_trainer=1))
    components.ps_job(config, module=JOB_MODULE, set=["fail_trainer=-1"])
    with pytest.raises(ConfigError, match=r"^--config: .*: fail_trainer: unknown key"):
        components.ps_job(config)


def test_dryrun_on_each_scheduler(config: str) -> None:
    """The runner turns the component into each scheduler's request without submitting it."""
    with get_runner() as runner:
        local = runner.dryrun_component(
            "distopt.ps_job", ["--config", config], "local_cwd", cfg={"log_dir": "/tmp/x"}
        )
        replicas = local.request.role_params
        assert sorted(replicas) == ["ps", "trainer"] and len(replicas["trainer"]) == 2
        assert replicas["trainer"][1].env["REPLICA_ID"] == "1"
        assert "TORCHX_RANK0_HOST" in replicas["trainer"][1].args[2]

        slurm = runner.dryrun_component("distopt.ps_job", ["--config", config], "slurm", cfg={})
        script = slurm.request.materialize()
        assert script.count("#SBATCH --job-name=") == 3 and script.count("#SBATCH hetjob") == 2
        assert "SLURM_JOB_NODELIST_HET_GROUP_0" in script

        pytest.importorskip("ray")
        ray = runner.dryrun_component(
            "distopt.ps_job", ["--config", config], "ray", cfg={"dashboard_address": "127.0.0.1:1"}
        )
        assert _ray_replicas(ray.request) == [("ps", 1, 0), ("trainer", 1, 0), ("trainer", 1, 0)]


def _torchx_builtin_components() -> set[str]:
    """What TorchX lists when no package registers components (see also tests/test_packaging.py)."""
    import inspect

    from torchx.specs.finder import ModuleComponentsFinder

    finder = ModuleComponentsFinder("torchx.components", "")
    # Newer TorchX's find() takes the linter's validators (None: its default ones); 0.7's none.
    takes_validators = "validators" in inspect.signature(finder.find).parameters
    found = finder.find(None) if takes_validators else finder.find()  # type: ignore[call-arg]
    return {c.name for c in found if not c.validation_errors}


def test_builtins_lists_ours_and_every_torchx_builtin() -> None:
    theirs = _torchx_builtin_components()
    out = torchx("builtins")
    assert out.returncode == 0, out.stderr
    listed = {line.split(". ", 1)[1] for line in out.stdout.splitlines() if ". " in line}
    assert listed == theirs | {"distopt.ps_job", "distopt.spmd"}
    assert "dist.ddp" in listed  # a builtin in every TorchX (0.7's metrics.*, serve.* are gone)


def test_cli_help_comes_from_docstrings() -> None:
    out = torchx("run", "distopt.ps_job", "--help")
    assert out.returncode == 0, out.stderr
    assert "Parameter-server training job" in out.stdout and "--num_trainers" in out.stdout


def _last_error_line(text: str) -> str:
    return [line for line in text.strip().splitlines() if line.strip()][-1].strip()


def test_cli_dryrun_prints_both_roles(config: str) -> None:
    out = torchx("run", "-s", "local_cwd", "--dryrun", "distopt.ps_job", "--config", config)
    assert out.returncode == 0, out.stderr
    assert "'ps': [" in out.stdout and "'trainer': [" in out.stdout


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        # TorchX's own message: 0.7 says "Component `distopt.no_such` not found. ...", newer
        # TorchX "Function no_such does not exist in distopt".
        (["distopt.no_such", "--config", "x.yaml"],
         re.compile(r"Component `distopt\.no_such` not found|Function no_such does not exist in distopt")),
        (["distopt.ps_job", "--config", "missing.yaml"], "--config: config file not found: missing.yaml"),
        (["distopt.ps_job", "--config", "{config}", "--num_trainers", "0"],
         "--num_trainers: expected an integer >= 1, got 0"),
        (["distopt.ps_job", "--config", TINY, "--set", "stpes=5"],
         f"--set: stpes: unknown key (known keys: {KNOWN})"),
        (["distopt.ps_job", "--config", TINY, "--set", "steps=abc"],
         "--set: steps: expected an integer, got 'abc'"),
        (["distopt.ps_job", "--config", TINY, "--set", "model_kwargs.sizes=[8,4,steps=5"],
         "--set: model_kwargs.sizes: cannot parse '[8,4,steps=5' as YAML "
         "(expected ',' or ']', but got '<stream end>')"),
    ],
)  # fmt: skip
def test_cli_bad_input_is_one_line(
    config: str, args: list[str], expected: str | re.Pattern[str]
) -> None:
    args = [a.replace("{config}", config) for a in args]
    out = torchx("run", "-s", "local_cwd", "--dryrun", *args)
    assert out.returncode == 1
    assert "Traceback" not in out.stderr
    line = _last_error_line(out.stderr)
    # Our errors are the whole line; TorchX's own say more after theirs.
    assert expected.search(line) if isinstance(expected, re.Pattern) else line == expected, line


def test_cli_list_values_reach_the_job() -> None:
    out = torchx("run", "-s", "local_cwd", "--dryrun", "distopt.ps_job", "--config", TINY,
                 "--set", "model_kwargs.sizes=[8,4],steps=5")  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "'model_kwargs.sizes=[8,4]' --set steps=5" in out.stdout  # one argument, list intact


def test_cli_unknown_scheduler(config: str) -> None:
    out = torchx("run", "-s", "nosuch", "--dryrun", "distopt.ps_job", "--config", config)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "invalid choice: 'nosuch'" in _last_error_line(out.stderr)


def test_torchxconfig_defaults_are_valid() -> None:
    """Every key in .torchxconfig is a known scheduler option (of distopt launch's schedulers:
    TorchX's and distopt_ray) or component argument."""
    import configparser
    import inspect

    from distopt.torchx.schedulers import get_runner as distopt_runner

    parser = configparser.ConfigParser()
    parser.read(REPO / ".torchxconfig")
    with distopt_runner() as runner:
        for section in parser.sections():
            keys = set(parser[section])
            if section.startswith("component:"):
                fn = getattr(components, section.split(".", 1)[1])
                assert keys <= set(inspect.signature(fn).parameters), section
            elif section != "cli:run":
                known = {name for name, _ in runner.scheduler_run_opts(section)}
                assert keys <= known, section
    assert parser["ray"]["dashboard_address"].startswith("127.0.0.1:")
