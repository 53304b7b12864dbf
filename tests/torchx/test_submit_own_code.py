"""``distopt launch`` on a user's own package kept outside the repository (``local_cwd``).

Bad job code is one line before anything is scheduled (nothing written); a job that fails names
the replica that failed first, its exit code, its error, the end of its log and where the logs
are; a job that succeeds streams trainer 0's progress and prints no warning or traceback, in its
own output or in any replica's log.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import pytest

from distopt.cli import main as cli
from tests.noise import noise
from tests.torchx.release import slurm_options

DISTOPT = str(Path(sys.executable).with_name("distopt"))

RPC_MODEL = '''
import torch
import torch.distributed.rpc as rpc
from torch import nn

ROWS, DIM = 64, 4
_TABLE = {}


def table():
    """Runs on the server: the table, made on first use there."""
    if "w" not in _TABLE:
        _TABLE["w"] = torch.randn(ROWS, DIM, generator=torch.Generator().manual_seed(0))
    return _TABLE["w"]


def lookup(ids):
    return table()[ids]


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.top = nn.Linear(DIM + 2, 1)

    def forward(self, dense, ids):
        rows = rpc.rpc_sync("ps0", lookup, args=(ids,))
        return self.top(torch.cat([dense, rows.sum(1)], 1))

    def ps_tables(self):
        return []  # the servers hold no distopt table: lookup keeps its own


def make_model():
    return Model()
'''

TABLE_MODEL = """
import torch
from torch import nn

import distopt
from distopt.ps import TableSpec


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.top = nn.Linear(4 + 2, 1)

    def forward(self, dense, ids):
        rows = distopt.ps.fetch("items", ids)
        return self.top(torch.cat([dense, rows.sum(1)], 1))

    def ps_tables(self):
        return [TableSpec(name="items", num_rows=64, dim=4)]


def make_model():
    return Model()
"""

DENSE_MODEL = """
import torch
from torch import nn


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.items = nn.Embedding(64, 4)
        self.top = nn.Linear(4 + 2, 1)

    def forward(self, dense, ids):
        return self.top(torch.cat([dense, self.items(ids).sum(1)], 1))


def make_model():
    return Model()
"""

DATA = """
import torch
from torch.utils.data import Dataset

from distopt.data import Batch


class Clicks(Dataset):
    def __init__(self, size, seed):
        gen = torch.Generator().manual_seed(seed)
        self.dense = torch.randn(size, 2, generator=gen)
        self.ids = torch.randint(0, 64, (size, 3), generator=gen)
        self.labels = (self.dense[:, :1] > 0).float()

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, index):
        return self.dense[index], self.ids[index], self.labels[index]

    @staticmethod
    def collate_fn(samples):
        dense, ids, labels = (torch.stack(column) for column in zip(*samples))
        return Batch((dense, ids), labels)


def make_data(split, seed, size=256):
    return Clicks(size, seed if split == "train" else seed + 1)
"""

JOB = """\
model: {pkg}.model:make_model
parallel: ddp
steps: 20
batch_size: 16
num_threads: 1
log_every: 10
data: {{source: '{pkg}.data:make_data', task: click}}
optim: {{name: adam, lr: 0.01}}
output_dir: runs
"""


def user_package(
    where: Path, *, model: str = RPC_MODEL, data: str = DATA, extra: str = ""
) -> tuple[Path, str]:
    """``where/<pkg>/`` (model.py, data.py, extra.py) and ``where/job.yaml``; the package name is
    new on every call, since in-process launches import it into this test process."""
    pkg = f"shop_{uuid.uuid4().hex[:8]}"
    (where / pkg).mkdir(parents=True)
    (where / pkg / "__init__.py").write_text("")
    for name, source in (("model", model), ("data", data), ("extra", extra)):
        (where / pkg / f"{name}.py").write_text(textwrap.dedent(source).replace("{pkg}", pkg))
    job = where / "job.yaml"
    job.write_text(JOB.format(pkg=pkg))
    return job, pkg


def _refused(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    *args: str,
    extra: str = "",
    **files: str,
) -> str:
    """``distopt launch job.yaml ARGS`` run in the package's directory: its one-line error, after
    checking that it exits 2 and schedules nothing."""
    job, pkg = user_package(tmp_path, extra=extra, **files)
    monkeypatch.chdir(tmp_path)
    code = cli(["launch", str(job), *[a.replace("{pkg}", pkg) for a in args]])
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert not (tmp_path / "runs").exists()  # nothing written, so nothing was scheduled
    assert "\n" not in err and err.startswith("distopt launch: error: "), err
    return (
        err.removeprefix("distopt launch: error: ")
        .replace(pkg, "{pkg}")
        .replace(str(tmp_path), "{dir}")
    )


def test_an_unknown_scheduler_option_is_refused_as_in_the_api(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 22 item 4: `--cfg partiton=gpu` on the command line was dropped (exit 0)."""
    message = _refused(
        tmp_path, capsys, monkeypatch, "-s", "slurm", "--cfg", "partiton=gpu", "--dryrun"
    )
    # The options known differ between TorchX releases.
    assert message == (
        f"cfg.partiton: not an option of the slurm scheduler (known: {slurm_options()}); "
        "did you mean 'partition'?"
    )
    # The Python API says the same through the same check.
    import distopt
    from distopt.errors import ConfigError

    with pytest.raises(ConfigError) as info:
        distopt.launch(tmp_path / "job.yaml", "slurm", dryrun=True, partiton="gpu")
    assert str(info.value) == message


def test_a_known_option_typed_from_the_command_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    job, _ = user_package(tmp_path)
    monkeypatch.chdir(tmp_path)
    code = cli(
        ["launch", str(job), "-s", "slurm", "--cfg", "partition=gpu,time=1:00:00", "--dryrun"]
    )
    out = capsys.readouterr().out
    assert code == 0 and "--partition=gpu" in out and "--time=1:00:00" in out, out[-2000:]


def test_a_dryrun_leaves_nothing_behind(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A new user's trial: `--dryrun` wrote runs/<run-id>/job.yaml every time."""
    job, _ = user_package(tmp_path)
    monkeypatch.chdir(tmp_path)
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    code = cli(["launch", str(job), "--run-id", "try", "--dryrun"])
    out = capsys.readouterr().out
    assert code == 0 and out.endswith("run id try: logs would go to runs/try\n"), out[-2000:]
    assert "'runs/try/job.yaml'" in out  # the config the job's processes would read
    after = sorted(
        p.relative_to(tmp_path) for p in tmp_path.rglob("*") if "__pycache__" not in p.parts
    )
    assert after == [p for p in before if "__pycache__" not in p.parts]


VARIANTS = """
import torch
import torch.distributed.rpc as rpc

from {pkg}.data import Batch, Clicks
from {pkg}.model import Model, lookup


class NoServers(Model):
    ps_tables = None  # as if the method were not written


class Elsewhere(Model):
    def forward(self, dense, ids):
        rows = rpc.rpc_sync("worker1", lookup, args=(ids,))
        return self.top(torch.cat([dense, rows.sum(1)], 1))


def make_plain():
    return NoServers()


def make_elsewhere():
    return Elsewhere()


def make_nested():
    def nearby(ids):
        return lookup(ids)

    class Nested(Model):
        def forward(self, dense, ids):
            rows = rpc.rpc_sync("ps0", nearby, args=(ids,))
            return self.top(torch.cat([dense, rows.sum(1)], 1))

    return Nested()


def make_failing():
    raise ValueError("no catalogue at /data/items.csv")


import distopt
from distopt.ps import RemoteEmbedding, TableSpec


class Undeclared(Model):
    # Reads two distopt tables, declares one of them (and one it never reads).

    def __init__(self):
        super().__init__()
        self.users = RemoteEmbedding("users", 2)

    def forward(self, dense, ids):
        rows = distopt.ps.fetch("items", ids).sum(1)
        return self.top(torch.cat([dense + self.users(ids[:, 0]), rows], 1))

    def ps_tables(self):
        return [TableSpec(name="users", num_rows=64, dim=2), TableSpec(name="shops", num_rows=8, dim=2)]


def make_undeclared():
    return Undeclared()


def data_by_mode(mode, seed):
    return Clicks(64, seed)


class Triples(Clicks):
    @staticmethod
    def collate_fn(samples):
        return tuple(torch.stack(column) for column in zip(*samples))


def data_as_triples(split, seed):
    return Triples(64, seed)


class ForgotIds(Clicks):
    @staticmethod
    def collate_fn(samples):
        dense, ids, labels = (torch.stack(column) for column in zip(*samples))
        return Batch((dense,), labels)


def data_forgot_ids(split, seed):
    return ForgotIds(64, seed)


class Dicts(Clicks):
    @staticmethod
    def collate_fn(samples):
        dense, ids, labels = (torch.stack(column) for column in zip(*samples))
        return {"dense": dense, "ids": ids, "label": labels}


def data_as_dicts(split, seed):
    return Dicts(64, seed)
"""


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (
            ["--set", "model={pkg}.extra:make_plain"],
            "model: NoServers.forward makes remote calls (rpc_sync('ps0', {pkg}.model.lookup) at "
            "{dir}/{pkg}/model.py:27), but NoServers has no ps_tables() method, so the job would start "
            "no parameter server and run as plain data parallel: add ps_tables() to NoServers (return [] "
            "when your own functions keep the tables on the servers, ps0, ps1, ...)",
        ),
        (
            ["--set", "model={pkg}.extra:make_elsewhere"],
            "model: Elsewhere.forward calls rpc_sync('worker1', {pkg}.model.lookup) at {dir}/{pkg}/extra.py:15, "
            "but 'worker1' is no process of this job (its RPC workers are ps0, trainer0, trainer1)",
        ),
        (
            ["--set", "model={pkg}.extra:make_nested"],
            "model: Nested.forward sends {pkg}.extra.make_nested.<locals>.nearby ({dir}/{pkg}/extra.py:33) to "
            "run on ps0, which imports it by name, but it is defined inside a function (or is a lambda): "
            "define it at the top level of a module of your package",
        ),
        (
            ["--set", "model={pkg}.extra:make_failing"],
            "model: {pkg}.extra:make_failing failed: ValueError: no catalogue at /data/items.csv (at "
            '{dir}/{pkg}/extra.py:40: raise ValueError("no catalogue at /data/items.csv"))',
        ),
        (
            ["--set", "data.source={pkg}.extra:data_by_mode"],
            "data.kwargs: missing a required argument: 'mode' for '{pkg}.extra:data_by_mode': the job calls "
            "{pkg}.extra:data_by_mode(mode, seed) as (seed=0): split and seed when it takes them, the rest "
            "from data.kwargs",
        ),
        (
            ["--set", "data.source={pkg}.extra:data_as_triples"],
            "data: a batch of {pkg}.extra:data_as_triples has 3 inputs and no targets, which "
            "Model.forward(dense, ids) does not take (too many positional arguments): make the collate "
            "function return distopt.data.Batch(inputs=(...), targets=...); a tuple or list is taken for "
            "the inputs alone",
        ),
        (  # a Batch already: the advice is about its inputs (a user's trial)
            ["--set", "data.source={pkg}.extra:data_forgot_ids"],
            "data: a batch of {pkg}.extra:data_forgot_ids has 1 inputs and targets, which "
            "Model.forward(dense, ids) does not take (missing a required argument: 'ids'): make the "
            "Batch's inputs the forward's arguments, in its order",
        ),
        (
            ["--set", "data.source={pkg}.extra:data_as_dicts"],
            "data: a batch of {pkg}.extra:data_as_dicts has 1 inputs and no targets, which "
            "Model.forward(dense, ids) does not take (missing a required argument: 'ids'): the batch "
            "is a dict ('dense', 'ids', 'label'), taken as one input: make the collate function "
            "return distopt.data.Batch(inputs=(...), targets=...)",
        ),
        (
            ["--set", "model={pkg}.extra:make_plain", "--num-ps", "1"],
            "num_ps: 1 parameter servers, but NoServers ({pkg}.extra:make_plain) has no ps_tables() method, "
            "which each server calls to learn its tables: add one (return [] when your own functions keep "
            "the tables on the servers)",
        ),
        (  # a model with ps_tables() and remote calls, launched without servers
            ["--num-ps", "0"],
            "num_ps: 0 parameter servers, but Model.forward makes remote calls (rpc_sync('ps0', "
            "{pkg}.model.lookup) at {dir}/{pkg}/model.py:27), which need the job's RPC group and its "
            "servers ps0, ps1, ...: launch with --num-ps 1 or more (or leave --num-ps out: a model "
            "with ps_tables() gets 1)",
        ),
        (  # a table read but not declared: was a TensorPipe EOF and a trainer's error, 41 s on
            ["--set", "model={pkg}.extra:make_undeclared"],
            "model: Undeclared.forward fetches table 'items' at {dir}/{pkg}/extra.py:55, but "
            "Undeclared.ps_tables() does not declare it (declared: 'shops', 'users'), so no server "
            "holds it: add distopt.ps.TableSpec(name='items', ...) to ps_tables()",
        ),
        (
            ["--set", "ps.backend=ray"],
            "ps.backend: 'ray' jobs have no RPC group, but Model.forward calls rpc_sync('ps0', "
            "{pkg}.model.lookup) at {dir}/{pkg}/model.py:27: use ps.backend: rpc, or distopt.ps tables",
        ),
    ],
)
def test_the_job_code_is_checked_before_scheduling(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    args: list[str],
    expected: str,
) -> None:
    """Issue 22 item 7: the factory contract, checked, each failure one line naming the thing."""
    assert _refused(tmp_path, capsys, monkeypatch, *args, extra=VARIANTS) == expected


def _launch(
    cwd: Path, *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """``distopt launch ...`` as a user types it, in ``cwd``."""
    return subprocess.run(
        [DISTOPT, "launch", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=420,
        env={**os.environ, **(env or {})},
    )


FAILING = """
import torch
import torch.distributed as dist

from {pkg}.model import Model


class Failing(Model):
    calls = 0

    def forward(self, dense, ids):
        Failing.calls += 1
        if Failing.calls == 4 and dist.get_rank() == 1:
            raise ValueError("item 7 is not in the catalogue")
        return super().forward(dense, ids)


def make_model():
    return Failing()
"""


@pytest.mark.slow
def test_a_failed_launch_names_the_replica_that_failed_first(tmp_path: Path) -> None:
    """Issue 22 item 3: `local_cwd://...: FAILED` and a run dir holding only job.yaml, before."""
    job, pkg = user_package(tmp_path, extra=FAILING)
    proc = _launch(tmp_path, str(job), "--set", f"model={pkg}.extra:make_model")
    assert proc.returncode == 1, proc.stderr[-3000:]
    handle, run_line = proc.stdout.splitlines()[:2]
    run_dir = tmp_path / run_line.split("logs in ")[1]
    report = proc.stderr[proc.stderr.index(f"{handle}: FAILED") :].splitlines()
    assert report[0] == (
        f"{handle}: FAILED: trainer 1 failed first (exit code 1): "
        "ValueError: item 7 is not in the catalogue"
    )
    app_logs = run_dir.resolve() / "logs" / "torchx" / handle.rsplit("/", 1)[1]
    assert report[1] == f"  last lines of {app_logs}/trainer/1/stderr.log:"
    tail = report[2 : report.index(next(line for line in report if line.startswith("  then: ")))]
    assert tail[-2:] == [
        '    [rank1]:     raise ValueError("item 7 is not in the catalogue")',
        "    [rank1]: ValueError: item 7 is not in the catalogue",
    ]
    assert re.fullmatch(
        r"  then: (ps 0|trainer 0) \(exit code 1\), (ps 0|trainer 0) \(exit code 1\)", report[-2]
    ), report[-2]
    assert report[-1] == f"  logs: {app_logs}/<role>/<replica>/{{stderr,stdout}}.log"
    assert (
        "item 7 is not in the catalogue" in (app_logs / "trainer" / "1" / "stderr.log").read_text()
    )
    # trainer 0's log was streamed while the job ran
    assert any(line.startswith("trainer/0 ") for line in proc.stderr.splitlines())


@pytest.mark.slow
@pytest.mark.parametrize(
    ("model", "variant", "replicas"),
    [
        (TABLE_MODEL, "baseline", ["ps/0", "trainer/0", "trainer/1"]),  # parameter server + DDP
        (TABLE_MODEL, "optimized", ["ps/0", "trainer/0", "trainer/1"]),
        (DENSE_MODEL, "optimized", ["trainer/0"]),  # torchrun: DDP only
    ],
    ids=["servers-baseline", "servers-optimized", "ddp-optimized"],
)
def test_a_successful_launch_streams_progress_and_is_quiet(
    tmp_path: Path, model: str, variant: str, replicas: list[str]
) -> None:
    """Issue 22 items 3 and 11: trainer 0's progress while it runs; no warning or traceback from
    torch, gloo, torchrun or TensorPipe in the launch's output or in any replica's log."""
    job, _ = user_package(tmp_path, model=model)
    proc = _launch(tmp_path, str(job), "--set", f"variant={variant}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    handle = proc.stdout.splitlines()[0]
    lines = proc.stderr.splitlines()
    assert lines[-1] == f"{handle}: SUCCEEDED"
    progress = [line for line in lines if "distopt.training.progress: step " in line]
    assert [line.split("step ")[1].split()[0] for line in progress] == ["10/20", "20/20"]
    assert all(line.startswith("trainer/0 ") for line in progress)
    assert noise(proc.stderr) == []
    logs = sorted((tmp_path / "runs").glob("*/logs/torchx/*/*/*/stderr.log"))
    assert [p.parent.relative_to(p.parents[2]).as_posix() for p in logs] == replicas
    for log in logs:
        assert noise(log.read_text()) == [], log


@pytest.mark.slow
def test_own_rpc_functions_run_on_the_servers_from_a_package_elsewhere(tmp_path: Path) -> None:
    """The servers import the functions the trainers send them (and the trainers the factories)
    from where the launching script imported them, not from the replicas' working directory."""
    package_dir, work_dir = tmp_path / "code", tmp_path / "work"
    work_dir.mkdir()
    job, _ = user_package(package_dir)
    script = package_dir / "launch_it.py"
    script.write_text(
        textwrap.dedent("""
        import sys
        from pathlib import Path

        import distopt

        job = distopt.launch(Path(__file__).with_name("job.yaml"), overrides=["steps=5"])
        with job:
            status = job.wait()
            failed = job.failure(status)
        print(failed.format() if failed else status.state.name)
        sys.exit(failed is not None)
    """)
    )
    proc = subprocess.run(
        [sys.executable, str(script)], cwd=work_dir, capture_output=True, text=True, timeout=420
    )
    assert proc.returncode == 0 and proc.stdout.strip() == "SUCCEEDED", (
        proc.stdout + proc.stderr[-2000:]
    )
    assert len(list((work_dir / "runs").glob("*/qps-rank*.jsonl"))) == 2
