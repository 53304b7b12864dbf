"""Packaging: the wheel that ``python -m build`` makes installs into a fresh venv, adds distopt's
TorchX components without hiding TorchX's own, and ``distopt demo`` runs from outside the checkout.

Torch comes from the CPU build pinned by ``constraints/cpu.txt`` (``torch==2.13.0+cpu``, a wheel
in this project's machines' find-links), so nothing big is downloaded; where no CPU build is
reachable the pin stops pip instead of letting it take PyPI's CUDA build. The package list of
pyproject.toml is checked without a build.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import zipfile
from importlib.util import find_spec
from pathlib import Path

import pytest

from tests.launchers.conftest import require
from tests.noise import noise

REPO = Path(__file__).resolve().parents[1]
CPU_PIN = REPO / "constraints" / "cpu.txt"
OURS = {"distopt.ps_job", "distopt.spmd"}


def test_pyproject_lists_every_package() -> None:
    """A package missing from [tool.setuptools] packages would be left out of the wheel."""
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    setuptools = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    found = {
        ".".join(p.parent.relative_to(REPO).parts) for p in REPO.glob("distopt/**/__init__.py")
    }
    assert set(setuptools["packages"]) == found | {"distopt.configs"}
    assert setuptools["package-dir"] == {"distopt.configs": "configs"}


def _pip_dry_run(
    *args: str | Path, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """``pip install --dry-run ARGS torch`` (torch alone, nothing else resolved)."""
    command = [
        sys.executable,
        "-m",
        "pip",
        "install",
        "--dry-run",
        "--no-deps",
        "--ignore-installed",
    ]
    command += [*args, "torch"]
    return subprocess.run(
        [str(c) for c in command], env=env, capture_output=True, text=True, timeout=300
    )


def _dry_run_version(*args: str | Path, env: dict[str, str] | None = None) -> str:
    """The torch version pip would install with ``ARGS``."""
    proc = _pip_dry_run("--quiet", "--report", "-", *args, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (torch,) = json.loads(proc.stdout)["install"]
    return str(torch["metadata"]["version"])


def test_cpu_pin_resolves_to_the_cpu_build() -> None:
    """What ``make install`` gets here (pip's own configuration: this machine's find-links)."""
    assert _dry_run_version("-c", CPU_PIN) == "2.13.0+cpu"


def test_cpu_pin_refuses_a_build_without_cpu(tmp_path: Path) -> None:
    """An index offering only ``torch 2.13.0`` (PyPI's CUDA build; here a stand-in wheel with no
    code) stops pip at the pin, instead of downloading it."""
    info = "torch-2.13.0.dist-info"
    with zipfile.ZipFile(tmp_path / "torch-2.13.0-py3-none-any.whl", "w") as wheel:
        wheel.writestr(f"{info}/METADATA", "Metadata-Version: 2.1\nName: torch\nVersion: 2.13.0\n")
        wheel.writestr(
            f"{info}/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
        )
        wheel.writestr(f"{info}/RECORD", "")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env["PIP_CONFIG_FILE"] = os.devnull  # no find-links, index or constraint of this machine
    index = ("--no-index", "--find-links", tmp_path)
    # Without the pin pip takes the stand-in; with it pip stops and says which pin.
    assert _dry_run_version(*index, env=env) == "2.13.0"
    proc = _pip_dry_run(*index, "-c", CPU_PIN, env=env)
    assert proc.returncode != 0, proc.stdout[-3000:]
    assert "(constraint) torch==2.13.0+cpu" in proc.stdout + proc.stderr, proc.stdout[-3000:]


def _run(
    *cmd: str | Path, cwd: Path, env: dict[str, str], timeout: float, quiet: bool = False
) -> str:
    """``cmd``'s stdout; it must succeed, and with ``quiet`` print no warning or traceback."""
    proc = subprocess.run(
        [str(c) for c in cmd], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
    )
    assert proc.returncode == 0, (
        f"{cmd}: exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    )
    if quiet:
        assert noise(proc.stderr) == [], proc.stderr[-3000:]
    return proc.stdout


def _copy_checkout(dest: Path) -> Path:
    """The files git would commit (tracked or new, not ignored), links kept as links: the build
    sees what a clean clone has, and nothing is written into the checkout."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=REPO, capture_output=True, text=True, check=True,
    ).stdout.split("\0")  # fmt: skip
    for name in filter(None, listed):
        src, dst = REPO / name, dest / name
        if not src.is_symlink() and not src.is_file():
            continue  # deleted in the working tree
        dst.parent.mkdir(parents=True, exist_ok=True)
        if src.is_symlink():
            dst.symlink_to(os.readlink(src))
        else:
            shutil.copy2(src, dst)
    return dest


def _builtins(venv: Path, cwd: Path, env: dict[str, str]) -> set[str]:
    out = _run(venv / "bin" / "torchx", "builtins", cwd=cwd, env=env, timeout=300)
    return {line.split(". ", 1)[1] for line in out.splitlines() if ". " in line}


def _schedulers(venv: Path, cwd: Path, env: dict[str, str]) -> list[str]:
    """TorchX's schedulers in ``venv``, its default (``torchx run`` without ``-s``) first."""
    probe = (
        "from torchx.schedulers import get_default_scheduler_name as d, get_scheduler_factories as f; "
        "print(d(), *f())"
    )
    return _run(venv / "bin" / "python", "-c", probe, cwd=cwd, env=env, timeout=300).split()


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_wheel_installs_cleanly_and_runs_the_demo(tmp_path: Path) -> None:
    require([] if find_spec("build") else ["build (pip install -e '.[dev]')"], "the packaging test")
    started = time.monotonic()
    # Nothing of the checkout or of this venv may leak into the fresh one.
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["OMP_NUM_THREADS"] = "1"
    src = _copy_checkout(tmp_path / "src")
    _run(sys.executable, "-m", "build", "--outdir", tmp_path / "dist", src,
         cwd=tmp_path, env=env, timeout=600)  # fmt: skip
    (wheel,) = (tmp_path / "dist").glob("distopt-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    dist_info = "-".join(wheel.name.split("-")[:2]) + ".dist-info"
    assert {n.split("/", 1)[0] for n in names} == {"distopt", dist_info}  # no launchers/
    assert {"distopt/configs/jobs/ps_dlrm.yaml", "distopt/torchx/components.py"} <= set(names)
    built = time.monotonic()

    venv = tmp_path / "venv"
    _run(sys.executable, "-m", "venv", venv, cwd=tmp_path, env=env, timeout=300)
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    pip = [venv / "bin" / "python", "-m", "pip", "install", "--quiet",
           "-c", CPU_PIN]  # fmt: skip
    _run(*pip, "torch", "torchx", cwd=tmp_path, env=env, timeout=900)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    before, schedulers = _builtins(venv, elsewhere, env), _schedulers(venv, elsewhere, env)
    _run(*pip, wheel, cwd=tmp_path, env=env, timeout=900)
    installed = time.monotonic()
    after = _builtins(venv, elsewhere, env)
    assert {"dist.ddp", "metrics.tensorboard", "serve.torchserve", "utils.echo"} <= before
    assert after == before | OURS, (sorted(after - before), sorted(before - after))
    # Installing distopt leaves TorchX's schedulers and default as they were (README: Ray without
    # TorchX's Ray scheduler).
    assert _schedulers(venv, elsewhere, env) == schedulers and schedulers[0] == "local_docker"

    # A successful demo is quiet: no warning or traceback line on stderr (issue 22).
    out = _run(
        "distopt",
        "demo",
        "--steps",
        "3",
        "--min-timed-s",
        "0",  # no pilot: the wheel's demo, not its timing, is under test
        "--rounds",
        "2",
        "--out",
        tmp_path / "runs",
        cwd=elsewhere,
        env=env,
        timeout=600,
        quiet=True,
    )
    assert "baseline job finished" in out and "optimized job finished" in out, out
    assert "baseline: held-out auc " in out and "optimized: held-out auc " in out, (
        out
    )  # a click log
    for variant in ("baseline", "optimized"):
        # demo --rounds alternates the variants: one run per variant and round.
        runs = sorted((tmp_path / "runs").glob(f"demo-*-{variant}-*"))
        assert len(runs) == 2, runs
        for run in runs:
            assert sorted(p.name for p in run.glob("qps-rank*.jsonl")) == [
                "qps-rank0.jsonl",
                "qps-rank1.jsonl",
            ]
    assert not any(elsewhere.iterdir())  # everything went under --out
    print(
        f"packaging: build {built - started:.0f}s, venv+install {installed - built:.0f}s, "
        f"demo {time.monotonic() - installed:.0f}s"
    )
    shutil.rmtree(venv)  # about 1 GB; kept when the test fails, to look into
