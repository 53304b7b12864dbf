"""Shared test helpers."""

from __future__ import annotations

import pytest
import torch

from distopt.dist.rendezvous import free_port

__all__ = ["free_port"]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked ``cuda`` need a GPU: skipped without one (``make test-gpu`` runs them).

    The tests of a module with a module-scoped fixture go to one xdist worker (``make test``
    runs ``--dist loadgroup``): split between two, each would start the fixture's job, Ray
    instance or server once more (the pipeline job fixture alone takes 70 s)."""
    for item in items:
        if _uses_module_fixture(item):
            item.add_marker(pytest.mark.xdist_group(item.module.__name__))
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


def _uses_module_fixture(item: pytest.Item) -> bool:
    info = getattr(item, "_fixtureinfo", None)  # pytest's per-test fixture closure
    if info is None or getattr(item, "module", None) is None:
        return False
    return any(
        fixturedef.scope == "module"
        for fixturedefs in info.name2fixturedefs.values()
        for fixturedef in fixturedefs
    )


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)
