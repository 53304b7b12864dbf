"""Pass interface and the registry that orders passes by declared constraints.

A pass is a small function ``fn(gm, ctx) -> PassResult`` described by a :class:`PassSpec` that
names the passes it must run after/before; the registry, not list order, decides the order, so
"split before hoist" is stated where the hoist pass is declared. Passes that enable each other
(sinking a wait lets an issue move up) share a ``fixed_point`` group: the runner repeats the group
until a round changes nothing, so no pass ever runs another.

Each built-in pass module declares its ``PASS``; :mod:`distopt.passes` lists them and adds them
here when it is imported. Users add theirs with :func:`register_pass`. The registry imports
nothing: what it holds is what was added.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch.fx

from distopt.errors import ConfigError

if TYPE_CHECKING:
    from distopt.estimate.ab import Measurer


@dataclass
class PassContext:
    """What a pass may read besides the graph: example inputs and its options.

    Passes never talk to other processes: what must be measured on the cluster (the α–β model of
    the collectives) or agreed among ranks (the partition plan) is done by the caller
    (:func:`distopt.parallelize`) and reaches a pass as an option.
    """

    example_inputs: tuple[Any, ...] | None = None
    options: dict[str, Any] = field(default_factory=dict)
    """Options of the pass being run (``OptimizeConfig.pass_options[name]``)."""
    training: bool = True
    measure: Measurer | None = None
    """How a pass whose gain depends on the machine times its rewrite (``None``: it applies
    unmeasured); see :mod:`distopt.passes.local.measured`."""


@dataclass
class PassResult:
    modified: bool
    detail: str = ""
    """One line for the explain report, e.g. ``"split 4 remote calls"``."""
    same_cost: bool = False
    """The rewrite removed only calls that compute nothing (``nn.Identity``): a timing of the
    graph before it holds for the graph after (:data:`CAPTURED` follows it)."""


PassFn = Callable[[torch.fx.GraphModule, PassContext], PassResult]

TIMED = "distopt_timed"
"""``GraphModule.meta`` key: median seconds of one call of the graphs a measured pass timed
(:mod:`distopt.passes.local.measured`), by :func:`timing_key`."""


def timing_key(gm: torch.fx.GraphModule, inputs: tuple[Any, ...]) -> tuple[str, tuple[Any, ...]]:
    """What a timing of ``gm`` holds for: its generated code and the inputs' shapes and types."""
    return gm.code, tuple(
        (tuple(t.shape), t.dtype, t.device, t.is_contiguous())
        if isinstance(t, torch.Tensor)
        else type(t).__name__
        for t in inputs
    )


CAPTURED = "distopt_captured"
"""``GraphModule.meta`` key: ``(timing_key, seconds)`` of the graph as captured, where it is all of
a model whose verification run took those seconds on those inputs (:func:`captured_seconds`)."""


def captured_seconds(gm: torch.fx.GraphModule, key: tuple[str, tuple[Any, ...]]) -> float | None:
    """The original model's verification run, when ``key`` is the graph as captured: that graph
    computes the model's ops on the same inputs, so the run is a sample of it that need not be
    taken again (a first sample only: it was the model's first call)."""
    captured: tuple[tuple[str, tuple[Any, ...]], float] | None = gm.meta.get(CAPTURED)
    return captured[1] if captured is not None and captured[0] == key else None


def measured_seconds(gm: torch.fx.GraphModule, inputs: tuple[Any, ...]) -> float | None:
    """Median seconds of one call of ``gm`` as it is now on such ``inputs``, if a measured pass
    timed it."""
    timed: dict[tuple[str, tuple[Any, ...]], float] = gm.meta.get(TIMED, {})
    return timed.get(timing_key(gm, inputs))


@dataclass(frozen=True)
class PassSpec:
    """One pass: its function and where it runs among the others."""

    name: str
    fn: PassFn
    after: tuple[str, ...] = ()
    before: tuple[str, ...] = ()
    default: bool = True
    """Part of the default pipeline (``passes=None``)."""
    options: tuple[str, ...] = ()
    """Option names the pass accepts in ``pass_options``."""
    fixed_point: str | None = None
    """Group name: adjacent passes of one group are repeated until a whole round changes nothing."""

    @property
    def summary(self) -> str:
        doc = (self.fn.__doc__ or "").strip()
        return doc.splitlines()[0] if doc else ""


_REGISTRY: dict[str, PassSpec] = {}


def register_pass(
    name: str,
    *,
    after: Iterable[str] = (),
    before: Iterable[str] = (),
    default: bool = True,
    options: Iterable[str] = (),
    fixed_point: str | None = None,
) -> Callable[[PassFn], PassFn]:
    """Register ``fn`` under ``name``; ``after``/``before`` name passes it must follow/precede.

    ``options`` are the keys the pass accepts in ``pass_options[name]`` (others are a
    :class:`ConfigError` before anything runs); ``fixed_point`` names a repeat group (module doc).
    """

    def decorate(fn: PassFn) -> PassFn:
        spec = PassSpec(
            name=name,
            fn=fn,
            after=tuple(after),
            before=tuple(before),
            default=default,
            options=tuple(options),
            fixed_point=fixed_point,
        )
        add_pass(spec)
        return fn

    return decorate


def add_pass(spec: PassSpec) -> None:
    """Add a declared pass; a name another function holds already is a :class:`ConfigError`."""
    held = _REGISTRY.get(spec.name)
    if held is not None and held.fn is not spec.fn:
        raise ConfigError(f"pass {spec.name!r} is already registered by {held.fn!r}")
    _REGISTRY[spec.name] = spec


def add_passes(specs: Iterable[PassSpec]) -> None:
    """Add several declared passes in name order, so the order they are listed in never matters:
    it only breaks ties their constraints leave (:func:`resolve_pipeline`)."""
    for spec in sorted(specs, key=lambda spec: spec.name):
        add_pass(spec)


def unregister_pass(name: str) -> None:
    _REGISTRY.pop(name, None)


def registered_passes() -> dict[str, PassSpec]:
    """Every pass added so far, by name, in the order they were added."""
    return dict(_REGISTRY)


def resolve_pipeline(names: Iterable[str | PassSpec] | None) -> list[PassSpec]:
    """The passes to run, in an order satisfying every constraint among them.

    ``None`` selects the default passes. Ties keep the caller's order, or for ``None`` the order
    passes were added (the built-ins by name, then the user's in registration order).
    """
    passes = registered_passes()
    if names is None:
        chosen = [spec for spec in passes.values() if spec.default]
    else:
        chosen = []
        for item in names:
            if isinstance(item, PassSpec):
                chosen.append(item)
                continue
            if not isinstance(item, str):
                raise ConfigError(f"passes: expected pass names, got {item!r}")
            if item not in passes:
                known = ", ".join(sorted(passes))
                raise ConfigError(f"passes: unknown pass {item!r} (known passes: {known})")
            chosen.append(passes[item])
    seen: set[str] = set()
    for spec in chosen:
        if spec.name in seen:
            raise ConfigError(f"passes: {spec.name!r} listed twice")
        seen.add(spec.name)
    position = {spec.name: i for i, spec in enumerate(chosen)}
    preds: dict[str, set[str]] = {spec.name: set() for spec in chosen}
    for spec in chosen:
        preds[spec.name].update(a for a in spec.after if a in position)
        for b in spec.before:
            if b in position:
                preds[b].add(spec.name)
    # Kahn's algorithm, always taking the earliest-listed ready pass: deterministic and stable.
    ordered: list[str] = []
    remaining = dict(preds)
    while remaining:
        ready = [n for n, p in remaining.items() if not p - set(ordered)]
        if not ready:
            cycle = ", ".join(sorted(remaining))
            raise ConfigError(f"passes: ordering constraints form a cycle among {cycle}")
        first = min(ready, key=position.__getitem__)
        ordered.append(first)
        del remaining[first]
    by_name = {spec.name: spec for spec in chosen}
    return [by_name[n] for n in ordered]
