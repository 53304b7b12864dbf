"""The checkout's TorchX entry points, for test processes whose installed distopt lacks them.

The test venv may hold distopt installed (editable) from another checkout, whose entry points are
not this checkout's ``pyproject.toml``. :func:`checkout_entry_points_env` writes a ``distopt``
dist-info carrying this checkout's entry points and puts it first on ``PYTHONPATH``: importlib
finds it before the installed one, so a ``torchx`` process sees exactly the table it would see
after ``pip install -e .`` of this checkout.
"""

from __future__ import annotations

import os
from importlib import metadata
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def pyproject_entry_points() -> dict[str, dict[str, str]]:
    """``[project.entry-points]`` of this checkout: group -> name -> object reference."""
    import tomllib  # Python >= 3.11 (the test venvs); the package itself needs no TOML parser

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    return {group: dict(eps) for group, eps in project["entry-points"].items()}


def installed_entry_points(group: str) -> dict[str, str]:
    """Entry points of ``group`` the installed ``distopt`` distribution declares."""
    try:
        eps = metadata.distribution("distopt").entry_points
    except metadata.PackageNotFoundError:
        return {}
    return {ep.name: ep.value for ep in eps if ep.group == group}


def installed_matches_checkout() -> bool:
    return installed_entry_points("torchx.schedulers") == pyproject_entry_points().get(
        "torchx.schedulers", {}
    )


def checkout_entry_points_env(tmp: Path) -> dict[str, str]:
    """Environment for a subprocess that must see this checkout's entry points ({} when the
    installed distopt already declares them)."""
    if installed_matches_checkout():
        return {}
    info = tmp / "distopt-0.1.0.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: distopt\nVersion: 0.1.0\n")
    sections = [
        # sorted by name, as setuptools writes them (TorchX's default scheduler is the first)
        f"[{group}]\n" + "".join(f"{name} = {eps[name]}\n" for name in sorted(eps))
        for group, eps in pyproject_entry_points().items()
    ]
    (info / "entry_points.txt").write_text("\n".join(sections))
    path = [str(tmp), str(REPO), os.environ.get("PYTHONPATH", "")]
    return {"PYTHONPATH": os.pathsep.join(p for p in path if p)}
