"""The ``distopt`` Dynamo backend: run distopt's passes on each graph Dynamo captures.

``torch.compile(model, backend="distopt")`` finds it through the ``torch_dynamo_backends`` entry
point; :func:`distopt.optimize` uses :func:`make_backend` for its Dynamo capture tier.
"""

from __future__ import annotations

import collections
import dataclasses
import types
import weakref
from collections.abc import Callable, Sequence
from typing import Any, cast

import torch
import torch.fx
from torch import nn

from distopt.errors import ConfigError, PassError
from distopt.estimate.ab import Measurer, measurer_for_this_process
from distopt.passes import PassSpec, resolve_pipeline, run_passes
from distopt.passes.local.measured import answering_first_call
from distopt.report import GraphRecord, OptimizeReport


def make_backend(
    pipeline: Sequence[PassSpec],
    *,
    pass_options: dict[str, dict[str, Any]] | None = None,
    report: OptimizeReport | None = None,
    strict: bool = False,
    inner: Callable[[torch.fx.GraphModule, list[Any]], Callable[..., Any]] | str | None = None,
    training: bool = True,
    measure: Measurer | None = None,
) -> Callable[[torch.fx.GraphModule, list[Any]], Callable[..., Any]]:
    """A Dynamo backend applying ``pipeline`` to every captured graph, then ``inner`` (or eager).

    ``inner`` is a backend function or the name ``"eager"``/``"inductor"`` (kernel fusion; needs
    a C++ compiler on CPU). A failing pass leaves that graph unoptimized (recorded in
    ``report``) unless ``strict``. ``training`` is the mode passes assume when the graph does not
    show it (:func:`graph_training`); ``measure`` lets machine-dependent passes time their
    rewrites on the real tensors of the call being compiled.
    """
    inner = _inner_backend(inner)

    def backend(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        record = GraphRecord(code_before=gm.code)
        inputs = real_inputs(gm)
        # The first graph of distopt.optimize's verification call, when no graph break ended it,
        # is the whole model: the original's verification run just timed what it computes.
        captured_s = None
        if report is not None and not report.graphs and not _ends_at_break(gm):
            captured_s = report.original_seconds
        if report is not None:
            report.graphs.append(record)
        try:
            run_passes(
                gm,
                pipeline,
                example_inputs=inputs,
                pass_options=pass_options,
                training=graph_training(gm, default=training),
                record=record,
                measure=measure,
                captured_s=captured_s,
            )
        except PassError as err:
            if strict:
                raise
            if report is not None:
                report.warnings.append(f"graph {len(report.graphs)} left unoptimized: {err}")
        if inner is not None:
            return inner(gm, example_inputs)
        if inputs is None:
            return gm.forward
        # The call compiling this graph runs it next, on the inputs a measured pass just ran it on.
        return answering_first_call(gm, inputs, gm.forward)

    return backend


def _ends_at_break(gm: torch.fx.GraphModule) -> bool:
    """Whether Dynamo compiled ``gm`` at a graph break (so it is not all of its frame); ``True``
    when this torch does not say."""
    reason = getattr(gm, "compile_subgraph_reason", None)  # torch private: GraphCompileReason
    return bool(getattr(reason, "graph_break", True))


def real_inputs(gm: torch.fx.GraphModule) -> tuple[Any, ...] | None:
    """The real values behind a Dynamo graph's placeholders, while Dynamo compiles the call that
    produced it (its example inputs are fake tensors); ``None`` when one is unknown."""
    values = []
    for node in gm.graph.find_nodes(op="placeholder"):
        arg = node.meta.get("grapharg")
        try:
            value = arg.example if arg is not None else None  # torch private: GraphArg
        except Exception:  # a value Dynamo no longer holds
            return None
        if value is None or isinstance(value, torch._subclasses.FakeTensor):
            return None
        values.append(value)
    return tuple(values)


_MODE_OPS = {torch.nn.functional.batch_norm: (5, False), torch.nn.functional.dropout: (2, True)}
"""Functions whose ``training`` argument shows the mode a graph was captured in: its position
and default."""


def graph_training(gm: torch.fx.GraphModule, *, default: bool) -> bool:
    """The mode a Dynamo graph was captured in: what its BatchNorm/dropout calls were told
    (Dynamo traces through ``self.training``), else ``default``."""
    for node in gm.graph.nodes:
        spec = _MODE_OPS.get(node.target) if node.op == "call_function" else None
        if spec is None:
            continue
        position, missing = spec
        flag = node.kwargs.get(
            "training", node.args[position] if len(node.args) > position else missing
        )
        if isinstance(flag, bool):
            return flag
    return default


def _inner_backend(
    inner: Callable[[torch.fx.GraphModule, list[Any]], Callable[..., Any]] | str | None,
) -> Callable[[torch.fx.GraphModule, list[Any]], Callable[..., Any]] | None:
    if inner is None or callable(inner):
        return inner
    if inner == "eager":
        return None
    if inner == "inductor":
        from torch._inductor.compile_fx import compile_fx  # a second to import: only if used

        # torch private API: compile_fx is a Dynamo backend, but its annotations are wider
        return compile_fx  # type: ignore[return-value]
    raise ConfigError(f"inner: expected 'eager', 'inductor' or a backend function, got {inner!r}")


@dataclasses.dataclass(frozen=True)
class _Compiled:
    """One graph the ``distopt`` backend compiled, and how to tell which module it came from."""

    record: GraphRecord
    code: types.CodeType | None
    """Code of the frame Dynamo compiled (a ``forward`` or a resume function after a break)."""
    params: tuple[weakref.ref[torch.Tensor], ...]
    """The module parameters the graph reads (Dynamo passes them as graph inputs)."""


_COMPILED: collections.deque[_Compiled] = collections.deque(maxlen=512)
"""Graphs the ``distopt`` backend compiled (the newest 512), so ``distopt.explain`` can report on
a ``torch.compile(backend="distopt")`` module."""


def _frame_code() -> types.CodeType | None:
    """The code object Dynamo is compiling right now (None if this torch does not say)."""
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator  # private: may move

        return InstructionTranslator.current_tx().f_code
    except Exception:  # a private API: explain then reports on every graph it compiled
        return None


def compiled_report(module: nn.Module) -> OptimizeReport | None:
    """The graphs the ``distopt`` backend compiled for ``torch.compile(module, backend="distopt")``:
    frames of the module's (and its submodules') ``forward`` and Dynamo's resume functions after
    their graph breaks. ``None`` when ``module`` is not such a compiled module."""
    original = getattr(module, "_orig_mod", None)
    if not isinstance(original, nn.Module) or not hasattr(module, "dynamo_ctx"):
        return None
    codes = {type(m).forward.__code__ for m in original.modules()}
    files = {code.co_filename for code in codes}
    params = {id(p) for p in original.parameters()}

    def ours(graph: _Compiled) -> bool:
        if graph.params:  # a graph that reads parameters belongs to the module that owns them
            return any(id(p) in params for ref in graph.params if (p := ref()) is not None)
        code = graph.code
        if code is None or code in codes:
            return True
        return code.co_filename in files and code.co_name.startswith("torch_dynamo_resume_in_")

    report = OptimizeReport(
        model=type(original).__qualname__, tier="dynamo (torch.compile backend='distopt')"
    )
    report.graphs = [graph.record for graph in _COMPILED if ours(graph)]
    if not report.graphs:
        report.warnings.append("no graph compiled yet: call the module once, then explain it")
    return report


def distopt_backend(
    gm: torch.fx.GraphModule, example_inputs: list[Any], *, options: dict[str, Any] | None = None
) -> Callable[..., Any]:
    """``torch.compile(backend="distopt")``: distopt passes on each graph, then eager or inductor.

    ``torch.compile(m, backend="distopt", options={"inner": "inductor", "passes": [...],
    "pass_options": {...}})`` picks the passes (default: the registry's defaults) and the backend
    that compiles the rewritten graph (default: run it eagerly).
    """
    opts = dict(options or {})
    unknown = set(opts) - {"inner", "passes", "pass_options"}
    if unknown:
        raise ConfigError(
            f"options: unknown key {sorted(unknown)[0]!r} (known: inner, pass_options, passes)"
        )
    pipeline = resolve_pipeline(opts.get("passes"))
    report = OptimizeReport(model="", tier="dynamo", pass_names=[s.name for s in pipeline])
    # Machine-dependent passes time their rewrites on the real tensors of the call being compiled.
    backend = make_backend(
        pipeline,
        pass_options=opts.get("pass_options"),
        report=report,
        inner=opts.get("inner"),
        measure=measurer_for_this_process(),
    )
    compiled = backend(gm, example_inputs)
    params = tuple(
        weakref.ref(cast(torch.Tensor, t))
        for t in (*example_inputs, *gm.parameters())
        if isinstance(t, nn.Parameter)
    )
    _COMPILED.extend(_Compiled(record, _frame_code(), params) for record in report.graphs)
    return compiled
