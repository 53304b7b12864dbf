"""Where the server actors of a ``ps.backend: ray`` job run: the Ray cluster and their placement.

:func:`connect` joins the cluster at ``ps.ray_address``, failing in one line within
``ps.start_timeout_s`` where ``ray.init`` would retry for a minute; :func:`reserve` takes one
placement group for all of a job's actors (they start whole or not at all, and die with the
process that created them); :func:`placed` puts actor ``i`` in bundle ``i``; :func:`release`
removes the group at the end of a job.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import ray
from ray._private import ray_constants
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from distopt.dist import rendezvous
from distopt.errors import ConfigError
from distopt.ps.spec import ServerOptions, ray_endpoint
from distopt.text import plural


def gcs_endpoint(address: str) -> tuple[str, int] | None:
    """``(host, port)`` that ``address`` names, ``None`` for ``auto`` without ``$RAY_ADDRESS`` and for
    ``local`` (Ray resolves them): ``auto`` is ``$RAY_ADDRESS`` when set, as in ``ray.init``."""
    if address == "auto":
        address = os.environ.get("RAY_ADDRESS") or "auto"
    return ray_endpoint(address)


def connect(address: str, *, timeout_s: float) -> None:
    """``ray.init(address=address)``, or a one-line :class:`ConfigError` naming ``ps.ray_address``
    within ``timeout_s`` when no cluster answers there."""
    endpoint = gcs_endpoint(address)
    if endpoint is not None:
        refused = rendezvous.probe(*endpoint, timeout_s=timeout_s)
        if refused is not None:
            where = f"{endpoint[0]}:{endpoint[1]}"
            raise ConfigError(
                f"ps.ray_address: no Ray cluster reachable at {where} within {timeout_s:g} s "
                f"(ps.start_timeout_s): {rendezvous.first_line(refused)}"
            )
        if rendezvous.is_loopback(endpoint[0]):
            single_host()
    try:
        ray.init(address=address, log_to_driver=False, logging_level=logging.WARNING)
    except (ConnectionError, RuntimeError, ValueError) as err:  # e.g. auto with no cluster
        raise ConfigError(
            f"ps.ray_address: cannot connect to Ray at {address!r}: {rendezvous.first_line(err)}"
        ) from None


def single_host() -> None:
    """Keep a connection to a loopback address on loopback.

    ``ray.init`` swaps a loopback address for this host's external one, where a head bound to
    loopback (``launchers.ray.cluster``) does not listen, unless the cluster is declared to be this
    host alone: ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``, which Ray reads once, when it is imported
    (here it already is), into the constant set below.
    """
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    ray_constants.ENABLE_RAY_CLUSTER = False


def reserve(options: ServerOptions) -> Any:
    """A ready placement group of ``options.num_servers`` bundles, or a one-line error naming
    ``ps.ray_num_cpus`` (with what the cluster has) when it cannot be placed within
    ``options.start_timeout_s``."""
    bundle: dict[str, float] = {"CPU": options.ray_num_cpus, **options.ray_resources}
    if options.ray_memory_mb:
        bundle["memory"] = options.ray_memory_mb * 2**20
    group = placement_group(
        [dict(bundle) for _ in range(options.num_servers)], strategy=options.ray_placement
    )
    ready, _ = ray.wait([group.ready()], timeout=options.start_timeout_s)
    if not ready:
        remove_placement_group(group)
        asked = {"CPU", "memory", *options.ray_resources}
        available = {k: v for k, v in ray.available_resources().items() if k in asked}
        cluster = ray.cluster_resources()
        unknown = sorted(set(options.ray_resources) - set(cluster))
        key = "ps.ray_resources" if unknown else "ps.ray_num_cpus"
        nodes = sorted(k for k in cluster if k.startswith("node:") and "__" not in k)
        have = f"; no node has {', '.join(unknown)} (nodes: {', '.join(nodes)})" if unknown else ""
        raise ConfigError(
            f"{key}: the Ray cluster could not place "
            f"{plural(options.num_servers, 'server actor')} of "
            f"{_bundle_text(options)} ({options.ray_placement}) within {options.start_timeout_s:g} s "
            f"(ps.start_timeout_s){have}; available now: {available}"
        )
    return group


def placed(options: ServerOptions, group: Any, index: int) -> dict[str, Any]:
    """``ActorClass.options(...)`` arguments putting server ``index`` in its bundle of ``group``."""
    resources: dict[str, Any] = {"num_cpus": options.ray_num_cpus}
    if options.ray_resources:
        resources["resources"] = dict(options.ray_resources)
    if options.ray_memory_mb:
        resources["memory"] = options.ray_memory_mb * 2**20
    strategy = PlacementGroupSchedulingStrategy(
        placement_group=group, placement_group_bundle_index=index
    )
    return {**resources, "scheduling_strategy": strategy}


def release(group: Any) -> None:
    """Remove the placement group (killing whatever still runs in it)."""
    remove_placement_group(group)


def _bundle_text(options: ServerOptions) -> str:
    memory = f" and {options.ray_memory_mb} MB" if options.ray_memory_mb else ""
    extra = "".join(f", {amount:g} {name}" for name, amount in options.ray_resources.items())
    return f"{options.ray_num_cpus:g} CPU{memory}{extra} each"
