"""``distopt.parallelize``: optimize, partition, and hand the model to DDP, FSDP2 or FSDP1."""

from __future__ import annotations

import dataclasses
import time
import warnings
import weakref
from collections.abc import Mapping
from typing import Any, Literal

import torch
import torch._dynamo
import torch.distributed as dist
import torch.fx
from torch import nn
from torch.distributed._composable.replicate import DDP as ReplicatedDDP
from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel, MixedPrecisionPolicy
from torch.nn.parallel import DistributedDataParallel

from distopt.config import from_dict
from distopt.dist.rendezvous import collective
from distopt.errors import ConfigError
from distopt.estimate.collectives import alpha_beta, min_unit_bytes
from distopt.optimize import optimize
from distopt.parallel.apply import (
    apply_compile,
    apply_ddp,
    apply_fsdp,
    apply_fsdp1,
    backward_free_units,
)
from distopt.parallel.fsdp_schedule import plan_fsdp_schedule
from distopt.parallel.regions import compilable_regions, path_ranges, structure
from distopt.parallel.units import agree_across_ranks, materialize_units, plan_of, unit_modules
from distopt.passes import resolve_pipeline
from distopt.passes.local.channels_last import run_channels_last
from distopt.report import OptimizeReport, ParallelRecord, attach, report_of
from distopt.text import plural

Strategy = Literal["ddp", "fsdp", "fsdp1"]
DType = Literal["float32", "bfloat16", "float16"]


@dataclasses.dataclass(kw_only=True, slots=True)
class ParallelizeConfig:
    strategy: Strategy = "fsdp"
    """``"fsdp"`` (FSDP2 ``fully_shard`` per unit), ``"fsdp1"`` (FullyShardedDataParallel) or ``"ddp"``."""
    num_units: int | None = None
    """Target unit count for the partition (default: one per repeated block, plus one)."""
    max_unit_bytes: int | None = None
    """Memory budget: parameter bytes per unit (overrides ``num_units``)."""
    fuse: bool = True
    """Merge units smaller than ``min_unit_bytes`` into their neighbours."""
    min_unit_bytes: int | None = None
    """Smallest unit worth a collective; default: from the measured α–β model of the group."""
    cache_dir: str | None = None
    """Cache directory of the α–β measurement (default ``~/.cache/distopt``)."""
    channels_last: bool = False
    """Run conv nets in channels-last layout (inputs converted at entry, outputs restored; under
    DDP the 4-D weights too, so that DDP's gradient buckets match their gradients' strides)."""
    compile: bool = False
    """``torch.compile`` each unit (or the whole module for DDP) before wrapping it."""
    compile_backend: str = "inductor"
    """Backend for ``compile``."""
    compile_regions: bool = True
    """With ``compile``: compile each repeated block once and reuse it for every block of the same
    structure (torch.compile's regional compilation, :mod:`distopt.parallel.regions`); compile
    time grows with distinct blocks, not depth. Off: each unit, or the whole module for DDP."""
    reshard_after_forward: bool = True
    """FSDP2: free unsharded unit parameters after forward (re-gathered in backward), except the
    last units, which the schedule keeps because backward needs them at once."""
    prefetch: bool = True
    """FSDP2: each unit's forward issues the next unit's all-gather (explicit forward prefetch)."""
    param_dtype: DType | None = None
    """FSDP2 mixed precision: dtype parameters are gathered and computed in (``None``: theirs)."""
    reduce_dtype: DType | None = None
    """FSDP2 mixed precision: dtype gradients are reduced in (``None``: ``param_dtype``'s)."""
    memory_slack: float = 0.2
    """FSDP2: extra per-rank parameter memory (fraction of the leanest schedule's) that may be
    spent to save all-gathers — edge units left to the root, the last units kept gathered from
    forward into backward (:mod:`distopt.parallel.fsdp_schedule`). 0 keeps only the last unit."""
    passes: tuple[str, ...] | None = None
    """Graph passes before partitioning; default: the registry's default passes."""
    verify: bool | None = None
    """Check the optimized graph against the model (default: when ``example_inputs`` are given)."""

    def __post_init__(self) -> None:
        if self.strategy not in ("ddp", "fsdp", "fsdp1"):
            raise ConfigError(f"strategy: expected 'ddp', 'fsdp' or 'fsdp1', got {self.strategy!r}")
        if isinstance(self.compile_backend, str):
            known = torch._dynamo.list_backends(exclude_tags=())
            if self.compile_backend not in known:
                raise ConfigError(
                    f"compile_backend: unknown torch.compile backend {self.compile_backend!r} "
                    f"(known: {', '.join(known)})"
                )
        if self.memory_slack < 0:
            raise ConfigError(f"memory_slack: expected a number >= 0, got {self.memory_slack!r}")
        if (self.param_dtype or self.reduce_dtype) and self.strategy != "fsdp":
            raise ConfigError(
                f"param_dtype: mixed precision needs strategy 'fsdp' (FSDP2), got {self.strategy!r}"
            )

    def mp_policy(self) -> Any:
        """FSDP2 ``MixedPrecisionPolicy`` of ``param_dtype``/``reduce_dtype`` (``None``: neither)."""
        if self.param_dtype is None and self.reduce_dtype is None:
            return None

        def dtype(name: str | None) -> Any:
            return None if name is None else getattr(torch, name)

        return MixedPrecisionPolicy(
            param_dtype=dtype(self.param_dtype), reduce_dtype=dtype(self.reduce_dtype)
        )


def timing_of(module: nn.Module) -> ParallelRecord | None:
    """What :func:`parallelize` did to produce ``module`` (its result): units, schedule, timing."""
    report = report_of(module)
    return report.parallel if report is not None else None


def _config(
    strategy: str | None,
    config: ParallelizeConfig | Mapping[str, Any] | None,
    overrides: dict[str, Any],
) -> ParallelizeConfig:
    data: dict[str, Any]
    if config is None:
        data = {}
    elif isinstance(config, ParallelizeConfig):
        data = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
    elif isinstance(config, Mapping):
        data = dict(config)
    else:
        raise ConfigError(
            f"config: expected ParallelizeConfig or a mapping, got {type(config).__name__}"
        )
    if strategy is not None:
        data["strategy"] = strategy
    data.update(overrides)
    return from_dict(ParallelizeConfig, data, prefix="parallelize")


def parallelize(
    model: nn.Module,
    strategy: Strategy | None = None,
    *,
    example_inputs: Any = None,
    config: ParallelizeConfig | Mapping[str, Any] | None = None,
    mesh: Any = None,
    process_group: Any = None,
    **overrides: Any,
) -> nn.Module:
    """Optimize ``model``'s graph, partition it into units, and wrap it for data parallelism.

    Call it on every rank after ``torch.distributed.init_process_group``. FSDP and DDP change
    the model's parameters in place (sharding, broadcast), so keep no other reference for
    training. ``state_dict()`` of the result has the original model's keys, for every strategy
    (DDP is applied as torch's composable ``replicate``, which adds no ``module.`` prefix).
    The collectives ``parallelize`` itself runs (agreeing on rank 0's partition, timing the
    group) wait at most the group's timeout and fail in one line naming the rank and the step.

    Args:
        model: the training model.
        strategy: ``"fsdp"``, ``"fsdp1"`` or ``"ddp"`` (overrides ``config.strategy``).
        example_inputs: one batch of positional inputs: used to profile unit costs and verify.
        config: :class:`ParallelizeConfig` or a mapping; keyword ``overrides`` replace its fields.
        mesh: FSDP2 device mesh (default: the world).
        process_group: FSDP1/DDP process group (default: the world).
    """
    cfg = _config(strategy, config, overrides)
    _check_not_wrapped(model)
    _check_group(mesh, process_group)
    timing = ParallelRecord(strategy=cfg.strategy)
    start = time.perf_counter()
    needs_units = cfg.strategy in ("fsdp", "fsdp1") or (cfg.compile and cfg.strategy != "ddp")
    passes = (
        list(cfg.passes) if cfg.passes is not None else [s.name for s in resolve_pipeline(None)]
    )
    options: dict[str, dict[str, Any]] = {}
    if cfg.channels_last:
        if "channels_last" not in passes:
            passes.append("channels_last")
        # Asked for, so applied unmeasured: every rank must choose the same layout.
        options["channels_last"] = {"measure": False}
    if needs_units:
        passes.append("partition")
        options["partition"] = {"num_units": cfg.num_units, "max_unit_bytes": cfg.max_unit_bytes}
        if cfg.fuse:
            passes.append("fuse_units")
            options["fuse_units"] = {"min_unit_bytes": _min_unit_bytes(cfg)}
    # NHWC kernels sum in another order: compare with float32 round-off tolerances, not 1e-6.
    verify = {"rtol": 1e-4, "atol": 1e-4} if cfg.channels_last else {}
    # Regional compile: repeated blocks stay single calls in the graph, so units call them.
    regions = compilable_regions(model) if cfg.compile and cfg.compile_regions else []
    capture = {"leaf_modules": [path for path, _ in regions]}
    optimized = optimize(
        model,
        example_inputs,
        passes=passes,
        config={"pass_options": options, "verify": verify, "capture": capture},
        verify=cfg.verify,
    )
    timing.optimize_seconds = time.perf_counter() - start

    start = time.perf_counter()
    root: nn.Module = optimized
    units: list[nn.Module] = []
    if needs_units:
        if isinstance(optimized, torch.fx.GraphModule) and plan_of(optimized) is not None:
            with collective("distopt.parallelize (rank 0's partition, sent to every rank)"):
                agree_across_ranks(optimized)
            root = materialize_units(optimized)
            units = unit_modules(root)
        else:
            warnings.warn(
                f"distopt.parallelize: {type(model).__name__} was not captured as one graph; "
                f"wrapping it with {cfg.strategy} without inner units",
                stacklevel=2,
            )
    timing.materialize_seconds = time.perf_counter() - start
    timing.units = len(units)
    timing.unit_bytes = [sum(p.numel() * p.element_size() for p in u.parameters()) for u in units]

    # The order is fixed by what each step needs from the ones before it:
    # 1. compile each unit first, so FSDP's hooks run outside compiled code and every unit is one
    #    compiled region (torchtitan: "compile per block, then FSDP");
    # 2. FSDP wraps/shards the compiled units, inner units before the root;
    # 3. DDP wraps the whole module last: it only registers gradient hooks and buckets.
    start = time.perf_counter()
    if cfg.compile:
        if not isinstance(root, torch.fx.GraphModule) and root is not model:
            # Dynamo captured the model: compiling replaces that capture (and would trace through
            # compiled blocks), so the model's own forward runs, with the layout done by hooks.
            root = model
            if cfg.channels_last:
                run_channels_last(root)
        apply_compile(
            units or [root], backend=cfg.compile_backend, regions=[block for _, block in regions]
        )
        timing.regions = len(regions)
        timing.compiled = _what_compiled(regions, units, cfg.compile_backend)
    optimize_report = report_of(optimized)
    fell_back = optimize_report is not None and optimize_report.fallback is not None
    if cfg.channels_last and cfg.strategy == "ddp" and not fell_back:
        # The channels-last recipe's model.to(memory_format=...): a convolution fed NHWC returns
        # NHWC weight gradients, and DDP lays its buckets out from the parameters' strides (at
        # the first forward; compiling is lazy, so this still comes first). Contiguous weights
        # would cost a copy per gradient and DDP's "Grad strides do not match bucket view
        # strides" warning. FSDP lays out its own shards. Not when optimize returned the model
        # as written (verification refused the layout): its warning says "unoptimized".
        # (Module.to documents memory_format; its typed overloads lack it.)
        root.to(memory_format=torch.channels_last)  # type: ignore[call-overload]
    if cfg.strategy == "fsdp":
        schedule = plan_fsdp_schedule(
            timing.unit_bytes,
            world_size=_world_size(mesh),
            memory_slack=cfg.memory_slack,
            backward_free=backward_free_units(units),
        )
        timing.schedule = schedule
        result = apply_fsdp(
            root,
            units,
            mesh=mesh,
            reshard_after_forward=cfg.reshard_after_forward,
            schedule=schedule,
            prefetch=cfg.prefetch,
            mp_policy=cfg.mp_policy(),
        )
    elif cfg.strategy == "fsdp1":
        result = apply_fsdp1(root, units, process_group=process_group)
    else:
        result = apply_ddp(root, process_group=process_group)
    timing.wrap_seconds = time.perf_counter() - start
    # The optimize report travels to the wrapper, so distopt.explain(result) tells the whole story.
    report = optimize_report or OptimizeReport(model=type(model).__qualname__, tier="")
    report.parallel = timing
    attach(result, report)
    _PARALLELIZED.add(model)
    return result


_PARALLELIZED: weakref.WeakSet[nn.Module] = weakref.WeakSet()
"""Models :func:`parallelize` was given: the wrapper it returned shares (FSDP: shards) their
parameters, so a second wrapper of the same model would all-reduce or shard them again."""


def _what_compiled(
    regions: list[tuple[str, nn.Module]], units: list[nn.Module], backend: str
) -> str:
    """``compile=True``'s work in words: the regions by path, or the units, or the module."""
    if regions:
        distinct = len({structure(block) for _, block in regions})
        rest = "units holding no block compiled whole" if units else "the rest runs eager"
        return (
            f"{backend}, {len(regions)} repeated blocks ({path_ranges([p for p, _ in regions])}) "
            f"as {plural(distinct, 'distinct structure')}, each compiled once; {rest}"
        )
    if units:
        return f"{backend}, each of the {plural(len(units), 'unit')} whole (no repeated blocks)"
    return f"{backend}, the whole module (no repeated blocks)"


def _check_not_wrapped(model: nn.Module) -> None:
    """Refuse a result of ``parallelize``, a model given to it before, or one the user already
    wrapped with DDP (``DistributedDataParallel`` or ``replicate``) or FSDP."""
    record = timing_of(model)
    if record is not None:
        why = f"is already wrapped by distopt.parallelize ({record.strategy})"
    elif model in _PARALLELIZED:
        why = "was already given to distopt.parallelize, whose result shares its parameters"
    elif isinstance(
        model, (DistributedDataParallel, ReplicatedDDP, FullyShardedDataParallel, FSDPModule)
    ):
        why = f"is already wrapped by {type(model).__name__}"
    else:
        return
    raise ConfigError(f"parallelize: {type(model).__name__} {why}: pass the model as written, once")


def _check_group(mesh: Any, process_group: Any) -> None:
    """Without a group, DDP and FSDP fail deep inside with torch's ``env://`` rendezvous error."""
    if mesh is not None or process_group is not None:
        return
    if not (dist.is_available() and dist.is_initialized()):
        raise ConfigError(
            "parallelize: no torch.distributed process group in this process: call "
            "torch.distributed.init_process_group() on every rank first (e.g. a script launched "
            "with torchrun --nproc-per-node N), or pass process_group= (DDP, FSDP1) or mesh= (FSDP2)"
        )


def _min_unit_bytes(cfg: ParallelizeConfig) -> int:
    """The configured minimum, else the one the measured α–β model of the group gives (every rank
    agrees on one model: see :func:`distopt.estimate.collectives.alpha_beta`)."""
    if cfg.min_unit_bytes is not None:
        return cfg.min_unit_bytes
    with collective("distopt.parallelize (timing all-gather and reduce-scatter for fuse_units)"):
        return min_unit_bytes(alpha_beta(cache_dir=cfg.cache_dir))


def _world_size(mesh: Any) -> int:
    if mesh is not None and hasattr(mesh, "size"):
        return int(mesh.size())
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
