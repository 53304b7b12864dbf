"""The data-parallel strategies, one function each; :func:`distopt.parallelize` composes them.

Every function changes or wraps the module it is given (as torchtitan's ``apply_*`` do) and takes
keyword-only options. ``units`` are the unit submodules from
:func:`distopt.parallel.units.materialize_units`, in execution order.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.fx
from torch import nn
from torch.distributed._composable.replicate import replicate
from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel, fully_shard
from torch.distributed.fsdp.wrap import lambda_auto_wrap_policy

from distopt.dist.rendezvous import keep_group
from distopt.parallel.fsdp_schedule import FsdpSchedule
from distopt.parallel.regions import compile_regions

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import MixedPrecisionPolicy


def apply_compile(
    units: Sequence[nn.Module], *, backend: Any = "inductor", regions: Sequence[nn.Module] = ()
) -> None:
    """``torch.compile`` each unit in place (kernel fusion inside a unit, FSDP hooks outside).

    With ``regions`` (the model's repeated blocks, :mod:`distopt.parallel.regions`) those are
    compiled instead, once per distinct structure, and only the units holding no region are
    compiled as a whole.
    """
    compile_regions(regions, backend=backend)
    held = {id(block) for block in regions}
    for unit in units:
        if not any(id(sub) in held for sub in unit.modules()):
            unit.compile(backend=backend)


def apply_fsdp(
    root: nn.Module,
    units: Sequence[nn.Module],
    *,
    mesh: DeviceMesh | None = None,
    reshard_after_forward: bool = True,
    schedule: FsdpSchedule | None = None,
    prefetch: bool = True,
    mp_policy: MixedPrecisionPolicy | None = None,
) -> nn.Module:
    """FSDP2: ``fully_shard`` every unit, then the root (which keeps the leftover parameters).

    Inner units first: ``fully_shard(root)`` only manages parameters no inner unit claimed, and
    the root's forward pre-hook is what schedules the inner units' prefetching.

    ``units`` are in execution order (the partition knows it from the graph). ``schedule`` (see
    :mod:`distopt.parallel.fsdp_schedule`) leaves some units to the root and keeps the last ones
    gathered from forward into backward; without it only the last unit is kept (backward needs it
    at once; torchtitan does the same for its last block). Its backward-free units (see
    :func:`backward_free_units`) are not gathered again in backward. With ``prefetch`` each unit's forward
    issues the next unit's all-gather (FSDP2 prefetches implicitly only in backward). None of this
    changes numerics, also when a forward no backward follows runs between ``backward()`` and
    ``step()`` (see :func:`reshard_unreleased`); ``mp_policy`` does (e.g. bf16 parameters for
    compute, fp32 gradient reduction), the same policy on every unit and the root.
    """
    precision: dict[str, Any] = {} if mp_policy is None else {"mp_policy": mp_policy}

    held = schedule.root_held if schedule is not None else frozenset()
    kept = schedule.keep_after_forward if schedule is not None else frozenset({len(units) - 1})
    sharded = [(i, unit) for i, unit in enumerate(units) if i not in held]
    backward_free = schedule.backward_free if schedule is not None else frozenset()
    for index, unit in sharded:
        fully_shard(
            unit,
            mesh=mesh,
            reshard_after_forward=reshard_after_forward and index not in kept,
            **precision,
        )
        if index in backward_free:
            unit.set_unshard_in_backward(False)  # type: ignore[operator]
    # FSDP2 keeps the root's own parameters unsharded after forward whatever this says (they are
    # needed again at once by backward), so the setting only matters for the inner units.
    fully_shard(root, mesh=mesh, reshard_after_forward=reshard_after_forward, **precision)
    if prefetch:
        for (_, unit), (_, following) in zip(sharded, sharded[1:], strict=False):
            unit.set_modules_to_forward_prefetch([following])  # type: ignore[operator]
    reshard_unreleased(root)
    return root


def reshard_unreleased(root: nn.Module) -> None:
    """Reshard the FSDP2 parameters under ``root`` that a forward gathered and no backward released.

    FSDP2 leaves the root's parameters, and the units kept from forward into backward, unsharded
    after forward: the backward that follows uses them, then reshards them. A forward that no
    backward follows (``torch.no_grad()`` to log a metric between ``backward()`` and ``step()``,
    or a grad-enabled one whose output is dropped) leaves them gathered; ``step()`` updates the
    shards, and the next forward would run on the stale gathered copies (``unshard`` is a no-op
    on gathered parameters). So ``root`` reshards them after a forward run without grad (no
    backward can follow it; this also frees them and gives ``parameters()`` back the shards that
    hold the gradients) and before any forward (what is still gathered then was gathered by a
    forward whose backward never ran). In a loop of forward, backward, step both find every
    parameter sharded and do nothing; two forwards before one backward cost an all-gather more
    (backward gathers again what the second forward released). Parameters kept by
    ``set_reshard_after_backward(False)`` are the user's to release, as in FSDP2.
    """
    modules = [m for m in root.modules() if isinstance(m, FSDPModule)]

    def reshard() -> None:
        if torch._C._current_graph_task_id() != -1:
            return  # a forward recomputed in backward (activation checkpointing) is FSDP2's own
        for module in modules:
            if _holds_unreleased(module):
                module.reshard()

    def before(_module: nn.Module, _args: Any) -> None:
        reshard()

    def after(_module: nn.Module, _args: Any, _output: Any) -> None:
        if not torch.is_grad_enabled():
            reshard()

    # Before FSDP2's own pre-hook (which would keep the stale copies); after its post-hook.
    root.register_forward_pre_hook(torch.compiler.disable(before), prepend=True)
    root.register_forward_hook(torch.compiler.disable(after))


def _holds_unreleased(module: FSDPModule) -> bool:
    """Whether ``module``'s parameters are gathered though FSDP2 reshards them after backward."""
    state = module._get_fsdp_state()
    # Recent torch: a list (one group per mesh); older: one group or None.
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None:
        groups = [state._fsdp_param_group]
    return any(
        group is not None and group.is_unsharded and group.reshard_after_backward
        for group in groups
    )


def backward_free_units(units: Sequence[nn.Module]) -> frozenset[int]:
    """Indices of the units whose backward reads none of their parameters: every parameter is the
    table of an ``nn.Embedding`` the unit's graph only calls (embedding's gradient needs the
    indices, not the table). A table also read another way (a tied output head, ``get_attr``),
    renormalized in place (``max_norm``) or with sparse gradients does not qualify. Only FSDP2
    releases that know ``set_unshard_in_backward`` can skip the gather: older ones get none."""
    if not hasattr(FSDPModule, "set_unshard_in_backward"):
        return frozenset()
    free = set()
    for index, unit in enumerate(units):
        if not isinstance(unit, torch.fx.GraphModule) or not any(True for _ in unit.parameters()):
            continue
        if any(node.op == "get_attr" for node in unit.graph.nodes):
            continue
        owners = [m for m in unit.modules() if any(p is not None for p in m._parameters.values())]
        if all(isinstance(m, nn.Embedding) and m.max_norm is None and not m.sparse for m in owners):
            free.add(index)
    return frozenset(free)


def apply_fsdp1(
    root: nn.Module,
    units: Sequence[nn.Module],
    *,
    process_group: ProcessGroup | tuple[ProcessGroup, ProcessGroup] | None = None,
) -> nn.Module:
    """FSDP1: ``FullyShardedDataParallel`` whose auto-wrap policy wraps exactly the units."""
    ids = {id(u) for u in units}
    policy = functools.partial(lambda_auto_wrap_policy, lambda_fn=lambda m: id(m) in ids)
    return FullyShardedDataParallel(
        root,
        process_group=process_group,
        auto_wrap_policy=policy,
        # Original parameters stay visible (optimizers, torch.compile, named_parameters).
        use_orig_params=True,
        device_id=_device_of(root),
    )


def apply_ddp(
    root: nn.Module,
    *,
    process_group: ProcessGroup | None = None,
    bucket_cap_mb: float | None = None,
) -> nn.Module:
    """DDP as a composable API (``replicate``, as torchtitan's ``apply_ddp``): gradient all-reduce
    hooks on ``root`` itself rather than a ``DistributedDataParallel`` wrapper, so the module keeps
    its parameter names and ``state_dict`` keys (no ``module.`` prefix), like FSDP2's
    ``fully_shard``; ``set_requires_gradient_sync(False)`` skips the all-reduce as on FSDP2.

    DDP itself is built at the first forward. Its process group is kept alive until exit
    (:func:`distopt.dist.rendezvous.keep_group`): a gloo group whose last reference is DDP's reducer can
    hang the process at ``destroy_process_group()`` or exit.
    """
    kwargs: dict[str, Any] = {}
    if process_group is not None:
        kwargs["process_group"] = process_group
    if bucket_cap_mb is not None:
        kwargs["bucket_cap_mb"] = bucket_cap_mb
    device = _device_of(root)
    if device is not None and device.type == "cuda":
        kwargs["device_id"] = device
    keep_group(
        process_group if process_group is not None else dist.distributed_c10d._get_default_group()
    )
    return replicate(root, **kwargs)


def _device_of(module: nn.Module) -> torch.device | None:
    for tensor in module.parameters():
        return tensor.device if tensor.device.type != "meta" else None
    return None
