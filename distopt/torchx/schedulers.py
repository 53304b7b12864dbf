"""The TorchX schedulers distopt launches on: TorchX's own, then distopt's Ray scheduler.

Installing distopt must leave TorchX as it was: the same schedulers, the same default. So distopt
declares no ``torchx.schedulers`` entry point, and its Ray scheduler
(:mod:`.ray_scheduler`) reaches TorchX in two ways that change nothing for anyone else:

* **distopt's own Runner.** :func:`get_runner` builds ``torchx.runner.Runner`` from TorchX's
  scheduler factories plus ``distopt_ray`` (always ours) and ``ray`` (ours only where TorchX has
  none). ``distopt launch -s ray`` and :func:`distopt.launch` work on any TorchX this way. As in
  TorchX's registry, a scheduler's module (and Ray with it) is imported when the scheduler is
  made, not when the schedulers are listed.
* **The opt-in ``distopt-torchx-ray`` distribution** (``plugins/torchx-ray``) for ``torchx run -s
  ray`` on TorchX without a ``ray`` scheduler. It registers through TorchX's plugin namespace
  package ``torchx_plugins.schedulers``, which TorchX 0.7 never reads.

Why not an entry point. TorchX 0.7 (``torchx.util.entrypoints.load_group``) returns the
``torchx.schedulers`` entry points *instead of* its builtins as soon as one exists, and takes the
first as its default scheduler. Re-registering the builtins does not give them back unchanged:
setuptools writes entry points sorted by name, so the default would become ``aws_batch``, and a
TorchX that has since removed builtins (torchx-nightly keeps local_docker, local_cwd, slurm and
kubernetes) would list schedulers it cannot load. Newer TorchX (``torchx.plugins``) merges
plugins with its builtins but puts plugins first, so any registration there makes it TorchX's
default (``torchx run`` without ``-s``): fine for a user who installs the plugin to get ``ray``,
not for everyone who installs distopt.
"""

from __future__ import annotations

import configparser
from collections.abc import Mapping, MutableMapping, Sequence
from typing import Any

from torchx.runner import Runner
from torchx.runner import config as torchx_config
from torchx.schedulers import SchedulerFactory, get_scheduler_factories
from torchx.schedulers.api import Scheduler

from distopt.errors import extra_missing

__all__ = ["apply_torchxconfig", "distopt_schedulers", "get_runner", "scheduler_factories"]


def _ray_scheduler(name: str, create: str) -> SchedulerFactory:
    """The factory ``create`` of :mod:`.ray_scheduler`, whose module is imported when a scheduler
    is made, not when the schedulers are listed: it imports Ray's job submission client (Ray is
    optional, ``distopt[ray]``). TorchX's own registry defers each scheduler's module the same way
    (``torchx.schedulers.get_scheduler_factories``)."""

    def run(session_name: str, **kwargs: Any) -> Scheduler:
        try:
            from distopt.torchx import ray_scheduler  # imports Ray: see above
        except ModuleNotFoundError as err:
            raise extra_missing(err, extra="ray", key=f"scheduler {name!r}") from None

        factory: SchedulerFactory = getattr(ray_scheduler, create)
        return factory(session_name, **kwargs)

    return run


def distopt_schedulers(torchx_names: Mapping[str, object]) -> dict[str, SchedulerFactory]:
    """distopt's scheduler factories by name, given TorchX's: ``ray`` only where TorchX has
    none (TorchX 0.7's own ``ray`` stays TorchX's)."""
    ours: dict[str, SchedulerFactory] = {
        "distopt_ray": _ray_scheduler("distopt_ray", "create_scheduler")
    }
    if "ray" not in torchx_names:
        ours["ray"] = _ray_scheduler("ray", "create_ray_scheduler")
    return ours


def scheduler_factories() -> dict[str, SchedulerFactory]:
    """TorchX's scheduler factories (in TorchX's order, so its default stays first), then
    distopt's."""
    torchx = get_scheduler_factories()
    return {**torchx, **distopt_schedulers(torchx)}


def get_runner(component_defaults: dict[str, dict[str, str]] | None = None) -> Runner:
    """``torchx.runner.get_runner()`` with distopt's schedulers as well (:func:`scheduler_factories`).

    TorchX's ``get_runner`` takes no factories, so the Runner is built as it builds it.
    """
    return Runner("torchx", scheduler_factories(), component_defaults)


def apply_torchxconfig(
    runner: Runner, scheduler: str, cfg: MutableMapping[str, object], dirs: Sequence[str]
) -> None:
    """Fill ``cfg`` with the ``[scheduler]`` options of the ``.torchxconfig`` files in ``dirs``
    that it lacks (``torchx.runner.config.apply``), for distopt's schedulers too.

    TorchX's loader looks the scheduler up in TorchX's own registry to type the values, so it
    refuses ``distopt_ray`` (and ``ray`` where TorchX has none); their options are read here.
    """
    if scheduler in get_scheduler_factories():
        torchx_config.apply(scheduler=scheduler, cfg=cfg, dirs=list(dirs))
        return
    known = {name for name, _ in runner.scheduler_run_opts(scheduler)}
    for path in torchx_config.find_configs(dirs):
        parser = configparser.ConfigParser()
        parser.optionxform = str  # type: ignore[assignment]  # keys keep their case
        parser.read(path)
        if not parser.has_section(scheduler):
            continue
        for name, value in parser.items(scheduler):
            # The first file (and the caller) wins, as in TorchX; distopt's options are strings.
            if name in known and name not in cfg:
                cfg[name] = None if value == "None" else value
