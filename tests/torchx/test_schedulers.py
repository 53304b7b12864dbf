"""Installing distopt leaves TorchX's schedulers alone; distopt's Runner adds its Ray scheduler.

TorchX reads its schedulers from installed metadata, so the registration tests run TorchX in
subprocesses that see this checkout's metadata, as setuptools builds it, in place of the installed
distopt's (which may be another checkout's editable install). Nothing of TorchX is mocked.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from torchx.schedulers import get_scheduler_factories

from distopt.torchx.ray_scheduler import RayJobScheduler
from distopt.torchx.schedulers import (
    apply_torchxconfig,
    distopt_schedulers,
    get_runner,
    scheduler_factories,
)

REPO = Path(__file__).resolve().parents[2]
PLUGIN = REPO / "plugins" / "torchx-ray"

# What TorchX itself says: the schedulers `torchx run -s` offers and its default (no `-s`).
PROBE = """
import json
from importlib import metadata
from importlib.util import find_spec
from torchx.schedulers import (
    DEFAULT_SCHEDULER_MODULES, get_default_scheduler_name, get_scheduler_factories,
)
dist = metadata.distribution("distopt")
print(json.dumps({
    "names": list(get_scheduler_factories()),
    "default": get_default_scheduler_name(),
    "builtins": list(DEFAULT_SCHEDULER_MODULES),
    "others": [ep.name for ep in metadata.entry_points(group="torchx.schedulers")],
    "plugins": find_spec("torchx_plugins") is not None,
    "distopt_groups": sorted({ep.group for ep in dist.entry_points}),
    "distopt_top_level": (dist.read_text("top_level.txt") or "").split(),
}))
"""


def _torchx_schedulers(*path: Path) -> dict[str, Any]:
    """TorchX's schedulers in a fresh interpreter with ``path`` first on ``sys.path``."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(map(str, [*path, REPO])))
    # Not from the checkout: `python -c` puts the working directory first on sys.path, where an
    # editable install's distopt.egg-info would shadow the metadata under test.
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True,
                         timeout=120, check=False, cwd=path[0] if path else None)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.splitlines()[-1])


@pytest.fixture(scope="module")
def with_distopt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """This checkout's ``distopt-*.dist-info`` exactly as setuptools writes it for a wheel."""
    out = tmp_path_factory.mktemp("with")
    hook = "import sys; from setuptools import build_meta; build_meta.prepare_metadata_for_build_wheel(sys.argv[1])"
    subprocess.run([sys.executable, "-c", hook, str(out)], cwd=REPO, check=True,
                   capture_output=True, timeout=120)  # fmt: skip
    return out


@pytest.fixture(scope="module")
def without_distopt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A ``distopt`` dist-info declaring nothing: first on the path it hides the installed
    distopt's metadata (importlib.metadata takes the first distribution of a name), as if
    distopt were not installed."""
    out = tmp_path_factory.mktemp("without")
    info = out / "distopt-0.0.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: distopt\nVersion: 0.0.0\n")
    return out


def test_installing_distopt_keeps_torchx_schedulers_and_default(
    with_distopt: Path, without_distopt: Path
) -> None:
    with_ = _torchx_schedulers(with_distopt)
    without = _torchx_schedulers(without_distopt)
    # The probes saw the metadata meant: this checkout's entry points, then none.
    assert "torchx.components" in with_["distopt_groups"] and without["distopt_groups"] == []
    assert with_["distopt_top_level"] == ["distopt"]  # no torchx_plugins portion in the wheel
    assert (with_["names"], with_["default"]) == (without["names"], without["default"])
    assert "torchx.schedulers" not in with_["distopt_groups"]
    if not without["others"] and not without["plugins"]:
        # Nothing else registers schedulers here: TorchX's own list, its first the default.
        assert with_["names"] == with_["builtins"] and with_["default"] == with_["builtins"][0]


def test_plugin_adds_ray_only_where_torchx_has_none(without_distopt: Path) -> None:
    """plugins/torchx-ray (on the path as after `pip install`): TorchX 0.7 never reads it,
    a TorchX without `ray` gets distopt's. A TorchX without either fails here, not skips."""
    without = _torchx_schedulers(without_distopt)
    plugged = _torchx_schedulers(without_distopt, PLUGIN)
    assert "ray" in plugged["names"], plugged
    if "ray" in without["builtins"]:  # TorchX 0.7: its own ray, and nothing changes
        assert (plugged["names"], plugged["default"]) == (without["names"], without["default"])
    else:  # registered plugins come first, so `ray` is TorchX's default (plugins/torchx-ray/README)
        assert set(plugged["names"]) == set(without["names"]) | {"ray"}


def test_ray_is_ours_only_where_torchx_has_none() -> None:
    theirs = {"local_cwd": object(), "ray": object()}
    assert set(distopt_schedulers(theirs)) == {"distopt_ray"}
    assert set(distopt_schedulers({"local_cwd": object()})) == {"distopt_ray", "ray"}


def test_distopt_runner_is_torchx_then_ours() -> None:
    torchx = list(get_scheduler_factories())
    ours = scheduler_factories()
    assert list(ours)[: len(torchx)] == torchx and "distopt_ray" in ours
    with get_runner() as runner:
        assert set(runner.scheduler_backends()) == set(ours)
        assert runner.scheduler_run_opts("distopt_ray").get("dashboard_address") is not None
    pytest.importorskip("ray")  # TorchX 0.7's Ray scheduler imports it
    ray = ours["ray"]("test")  # TorchX's own where it has one (0.7)
    assert isinstance(ray, RayJobScheduler) == ("ray" not in torchx or _plugin_ray())


def _plugin_ray() -> bool:
    """Whether TorchX's `ray` is the distopt-torchx-ray plugin's."""
    factory = get_scheduler_factories().get("ray")
    return getattr(factory, "__module__", "") == "torchx_plugins.schedulers.distopt_ray"


def test_torchxconfig_sections_of_distopt_schedulers(tmp_path: Path) -> None:
    """TorchX's own loader refuses schedulers it has not registered; distopt reads theirs."""
    (tmp_path / ".torchxconfig").write_text(
        "[distopt_ray]\ndashboard_address = 127.0.0.1:1\nworking_dir = None\nnot_an_option = x\n"
        "[local_cwd]\nlog_dir = runs/x\n"
    )
    with get_runner() as runner:
        # distopt's options are strings, so the section's text is their value.
        assert {opt.opt_type for _, opt in runner.scheduler_run_opts("distopt_ray")} == {str}
        cfg: dict[str, object] = {"requirements": "r.txt"}
        apply_torchxconfig(runner, "distopt_ray", cfg, [str(tmp_path)])
        assert cfg == {
            "requirements": "r.txt",
            "dashboard_address": "127.0.0.1:1",
            "working_dir": None,
        }
        given: dict[str, object] = {"dashboard_address": "10.0.0.1:2"}
        apply_torchxconfig(runner, "distopt_ray", given, [str(tmp_path)])
        assert given["dashboard_address"] == "10.0.0.1:2"  # the caller's value wins
        local: dict[str, object] = {}
        apply_torchxconfig(runner, "local_cwd", local, [str(tmp_path)])  # TorchX's own loader
        assert local == {"log_dir": "runs/x"}


def test_listing_distopt_schedulers_imports_no_ray() -> None:
    """The Ray scheduler's module imports Ray (optional): it is loaded when the scheduler is made,
    as TorchX loads its own, not when a Runner lists schedulers."""
    code = (
        "import sys\n"
        "from distopt.torchx.schedulers import get_runner\n"
        "with get_runner() as runner:\n"
        "    assert 'distopt_ray' in runner.scheduler_backends()\n"
        "assert 'ray' not in sys.modules, 'listing schedulers imported ray'\n"
        "assert 'distopt.torchx.ray_scheduler' not in sys.modules\n"
        "with get_runner() as runner:\n"
        "    assert runner.scheduler_run_opts('distopt_ray').get('dashboard_address')\n"
        "assert 'distopt.torchx.ray_scheduler' in sys.modules\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]


WITHOUT_RAY = """
import sys
sys.modules["ray"] = None  # as if Ray were not installed: `import ray` raises ModuleNotFoundError
from distopt.errors import ConfigError
from distopt.ps.cluster.session import BACKENDS
from distopt.torchx.schedulers import distopt_schedulers
for make in (BACKENDS["ray"], lambda: distopt_schedulers({})["distopt_ray"]("s")):
    try:
        make()
    except ConfigError as err:
        print(err)
"""


def test_a_ray_choice_without_ray_installed_is_one_line() -> None:
    out = subprocess.run([sys.executable, "-c", WITHOUT_RAY], capture_output=True, text=True)
    assert out.returncode == 0 and out.stderr == "", out.stderr
    install = f"is not installed in {sys.executable}: pip install 'distopt[ray]'"
    assert out.stdout.splitlines() == [
        f"ps.backend: ray needs ray, which {install}",
        f"scheduler 'distopt_ray' needs ray, which {install}",
    ]
