"""Keep a rewrite only where it measured faster: the shared body of machine-dependent passes.

A layout or kernel choice that wins on one machine loses on another (a tiny conv net pays
channels-last conversions it never earns back). :func:`keep_if_faster` applies the rewrite, times
the graph with and without it on the example inputs (:class:`distopt.estimate.ab.Measurer`:
interleaved rounds, medians, a margin) and undoes it when it is not faster; the pass's report line
carries both timings either way. Only eval graphs are measured (a forward under ``no_grad``, the
user's RNG, buffers and input tensors left as they were): there a layout or kernel is purely a
speed choice, while in training it also changes the gradients' round-off, which BatchNorm on a
small batch amplifies, so training graphs get such rewrites only on request.

Each median is kept with the graph (``GraphModule.meta``, by
:func:`~distopt.passes.core.pass_base.timing_key`: its generated code and the inputs' shapes): a
later measured pass whose "without" is a graph timed already — the "with" of the pass before it,
or its "without" when that pass was declined — starts from that median instead of calling the
graph again, and :func:`distopt.optimize`'s final check takes the optimized graph's median from
it. The graph as captured starts from the original model's verification run when the graph is all
of that model (:func:`~distopt.passes.core.pass_base.captured_seconds`): it computes the same ops
on the same inputs. And the call that compiles a Dynamo graph, which then runs it on the tensors a
measured pass just timed it on, gets that timed call's outputs (:func:`answering_first_call`) when
it runs without grad, as the timed call did, and that call wrote and drew nothing.

The pass option ``measure: false`` applies the rewrite unmeasured (unit tests of a rewrite,
``parallelize(channels_last=True)``, where every rank must make the same choice). Without a
measurer (``config.measure.enabled: false``) or without example inputs the rewrite is not applied.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import re
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.fx

from distopt.estimate.ab import entered_untimed
from distopt.passes.core.pass_base import (
    TIMED,
    PassContext,
    PassResult,
    captured_seconds,
    timing_key,
)
from distopt.remote.isolation import RngStates, forked_rng, isolated, preserved_state
from distopt.remote.ops import remote_ops
from distopt.remote.side_effects import eliminate_dead_code

Rewrite = Callable[[torch.fx.GraphModule], tuple[bool, str]]
"""Changes the graph in place; returns whether it changed anything and the report line."""

LAST_RUN = "distopt_last_run"
"""``GraphModule.meta`` key: the graph's last timed call, kept for :func:`answering_first_call`."""

CONTAINER = "distopt_fused"
"""Submodule holding the modules fusion passes add (:mod:`distopt.passes.local.fused`)."""


def container(gm: torch.fx.GraphModule) -> torch.nn.Module:
    """The submodule new fused modules go into (created on first use)."""
    if not hasattr(gm, CONTAINER):
        gm.add_module(CONTAINER, torch.nn.Module())
    holder: torch.nn.Module = getattr(gm, CONTAINER)
    return holder


def add_fused(gm: torch.fx.GraphModule, name: str, module: torch.nn.Module) -> str:
    """Register ``module`` under a fresh name in :func:`container`; returns its target path."""
    holder = container(gm)
    base = re.sub(r"\W", "_", name)
    unique, i = base, 1
    while hasattr(holder, unique):
        unique, i = f"{base}_{i}", i + 1
    holder.add_module(unique, module)
    return f"{CONTAINER}.{unique}"


def keep_if_faster(gm: torch.fx.GraphModule, ctx: PassContext, rewrite: Rewrite) -> PassResult:
    """Apply ``rewrite``; keep it only if ``gm`` then measures faster (module docstring)."""
    measurer = ctx.measure
    if ctx.options.get("measure") is False:
        changed, detail = rewrite(gm)
        return PassResult(
            modified=changed,
            detail=f"{detail} (not measured: measure=false)" if changed else detail,
        )
    unmeasurable = _why_unmeasurable(gm, ctx)
    if unmeasurable is not None:
        return PassResult(
            modified=False,
            detail=f"not applied: {unmeasurable} (pass option measure=false applies it)",
        )
    saved = copy.deepcopy(gm.graph)
    had_container = hasattr(gm, CONTAINER)
    children_before = set(dict(container(gm).named_children())) if had_container else set()
    changed, detail = rewrite(gm)
    if not changed:
        _drop_added(gm, had_container, children_before)
        return PassResult(modified=False, detail=detail)
    # Time the graph the runner will keep: its dead-code elimination would change the code.
    eliminate_dead_code(gm)
    gm.recompile()
    baseline = torch.fx.GraphModule(gm, copy.deepcopy(saved))
    inputs = ctx.example_inputs
    assert inputs is not None  # _why_unmeasurable checked
    assert measurer is not None  # _why_unmeasurable checked
    timed: dict[tuple[str, tuple[Any, ...]], float] = gm.meta.setdefault(TIMED, {})
    before, after = timing_key(baseline, inputs), timing_key(gm, inputs)
    runs: dict[str, _LastRun] = {}

    def run(label: str, module: torch.fx.GraphModule, key: tuple[str, tuple[Any, ...]]) -> None:
        runs[label] = _workload(module, inputs, key)

    known = timed.get(before)
    result = measurer.compare(
        lambda: run("baseline", baseline, before),
        lambda: run("candidate", gm, after),
        baseline_s=known if known is not None else captured_seconds(gm, before),
    )
    if known is not None or result.baseline_timed:  # a median of this graph's own calls
        timed[before] = result.baseline_s
    timed[after] = result.candidate_s
    if measurer.keeps(result):
        _remember(gm, runs.get("candidate"))
        return PassResult(modified=True, detail=f"{detail}; kept: measured {result.describe()}")
    gm.graph = saved
    _drop_added(gm, had_container, children_before)
    _remember(gm, runs.get("baseline"))
    return PassResult(modified=False, detail=f"declined ({detail}): measured {result.describe()}")


def _why_unmeasurable(gm: torch.fx.GraphModule, ctx: PassContext) -> str | None:
    if ctx.training:
        return "training mode (layouts and kernels change gradients' round-off; only on request)"
    if ctx.measure is None:
        return "measuring is off (config measure.enabled=false)"
    if ctx.example_inputs is None:
        return "no example inputs to measure it on"
    if remote_ops(gm.graph):
        return "the graph makes remote calls, which timing runs must not repeat"
    return None


def _drop_added(gm: torch.fx.GraphModule, had_container: bool, children_before: set[str]) -> None:
    if not had_container:
        if hasattr(gm, CONTAINER):
            delattr(gm, CONTAINER)
        return
    holder = container(gm)
    for name in [n for n, _ in holder.named_children() if n not in children_before]:
        delattr(holder, name)


@dataclasses.dataclass(frozen=True)
class _LastRun:
    """One timed call of a graph: what it returned, and on what."""

    key: tuple[str, tuple[Any, ...]]
    """:func:`timing_key` of the graph that ran."""
    inputs: tuple[tuple[Any, int | None], ...]
    """Each input, with its version counter when it is a tensor."""
    outputs: Any
    mode: tuple[bool, bool]
    """Grad mode and inference mode it ran in (:func:`_mode`): always without grad, so its outputs
    carry no autograd history, and fused modules took their inference-only kernels
    (:mod:`distopt.passes.local.fused`), whose round-off differs from the differentiable path's."""
    wrote: bool
    """The call wrote a buffer or an input (put back afterwards), or drew random numbers (the
    generator put back): its outputs stand for a call only together with those writes."""


def _mode() -> tuple[bool, bool]:
    """What decides how a graph computes besides its inputs: whether autograd records its ops,
    and inference mode (whose tensors are another kind)."""
    return torch.is_grad_enabled(), torch.is_inference_mode_enabled()


def _workload(
    module: torch.nn.Module, inputs: tuple[Any, ...], key: tuple[str, tuple[Any, ...]]
) -> _LastRun:
    """One inference call. Nothing the user holds changes: the RNG, the module's buffers, and
    tensors passed in (a Dynamo graph receives the model's parameters and buffers as inputs).
    Putting those aside and back is the measurement's work, not the call's."""
    with entered_untimed(
        preserved_state(module), _restored(inputs), isolated(), forked_rng(), torch.no_grad()
    ) as (buffers, written, *_):
        rng = RngStates.now()
        outputs = module(*inputs)
        drew = not rng.same_as(RngStates.now())
        mode = _mode()
    return _LastRun(key, _versions(inputs), outputs, mode, bool(buffers or written or drew))


def _versions(inputs: Sequence[Any]) -> tuple[tuple[Any, int | None], ...]:
    return tuple((t, t._version if isinstance(t, torch.Tensor) else None) for t in inputs)


def _remember(gm: torch.fx.GraphModule, run: _LastRun | None) -> None:
    if run is not None and not run.wrote:
        gm.meta[LAST_RUN] = run
    else:
        gm.meta.pop(LAST_RUN, None)


def answering_first_call(
    gm: torch.fx.GraphModule, inputs: Sequence[Any], forward: Callable[..., Any]
) -> Callable[..., Any]:
    """``forward`` (``gm``'s), whose first call returns the outputs of the graph's last timed call
    instead of computing them again, when it is called on the very inputs of that call, none
    changed since, in the mode that call ran in (no grad), and the graph is still the one that ran.

    A Dynamo backend compiles a graph during the call that then runs it: the call that captured a
    graph, on the example inputs, would otherwise run it right after the measured pass ran it on
    those tensors (distopt.optimize's verification run of an eval model, which runs without
    grad). That call wrote nothing and drew no random numbers (else it is not remembered) and ran
    under the same RNG state, so its outputs are the outputs of this call. A call with grad
    enabled is computed: a timed call's outputs have no autograd history, and fused modules took
    their inference kernels (a model optimized in train mode, then called in eval mode with grad
    on, compiles its eval graph in such a call).
    """
    run: _LastRun | None = gm.meta.pop(LAST_RUN, None)
    if run is None or run.key != timing_key(gm, tuple(inputs)):
        return forward
    pending: list[_LastRun] = [run]

    def call(*args: Any) -> Any:
        last = pending.pop() if pending else None
        if last is not None and _mode() == last.mode and _same(args, last.inputs):
            return last.outputs
        return forward(*args)

    return call


def _same(args: Sequence[Any], inputs: tuple[tuple[Any, int | None], ...]) -> bool:
    return len(args) == len(inputs) and all(
        arg is value and (version is None or arg._version == version)
        for arg, (value, version) in zip(args, inputs, strict=True)
    )


@contextlib.contextmanager
def _restored(inputs: tuple[Any, ...]) -> Iterator[list[torch.Tensor]]:
    """Put back the values of input tensors (not parameters) a call wrote in place; yields the list
    of those it put back (filled on exit)."""
    saved = [
        (t, t.detach().clone())
        for t in inputs
        if isinstance(t, torch.Tensor) and not isinstance(t, torch.nn.Parameter)
    ]
    written: list[torch.Tensor] = []
    try:
        yield written
    finally:
        with torch.no_grad():  # compared by value: see distopt.remote.isolation.preserved_state
            for tensor, value in saved:
                if not torch.equal(tensor, value):
                    tensor.copy_(value)
                    written.append(tensor)
