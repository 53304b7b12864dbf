"""The ``distopt`` Dynamo backend: run distopt's passes on each graph Dynamo captures.

``torch.compile(model, backend="distopt")`` finds it through the ``torch_dynamo_backends`` entry
point; :func:`distopt.optimize` uses :func:`make_backend` for its Dynamo capture tier.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch.fx

from distopt.errors import ConfigError, PassError
from distopt.passes import PassSpec, resolve_pipeline, run_passes
from distopt.report import GraphRecord, OptimizeReport


def make_backend(
    pipeline: Sequence[PassSpec],
    *,
    pass_options: dict[str, dict[str, Any]] | None = None,
    report: OptimizeReport | None = None,
    strict: bool = False,
    inner: Callable[[torch.fx.GraphModule, list[Any]], Callable[..., Any]] | str | None = None,
) -> Callable[[torch.fx.GraphModule, list[Any]], Callable[..., Any]]:
    """A Dynamo backend applying ``pipeline`` to every captured graph, then ``inner`` (or eager).

    ``inner`` is a backend function or the name ``"eager"``/``"inductor"`` (kernel fusion; needs
    a C++ compiler on CPU). A failing pass leaves that graph unoptimized (recorded in
    ``report``) unless ``strict``.
    """
    inner = _inner_backend(inner)

    def backend(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        record = GraphRecord(code_before=gm.code)
        if report is not None:
            report.graphs.append(record)
        try:
            # Dynamo's example inputs are fake tensors: passes that profile must not run them.
            run_passes(gm, pipeline, pass_options=pass_options, training=gm.training, record=record)
        except PassError as err:
            if strict:
                raise
            if report is not None:
                report.warnings.append(f"graph {len(report.graphs)} left unoptimized: {err}")
        return inner(gm, example_inputs) if inner is not None else gm.forward

    return backend


def _inner_backend(
    inner: Callable[[torch.fx.GraphModule, list[Any]], Callable[..., Any]] | str | None,
) -> Callable[[torch.fx.GraphModule, list[Any]], Callable[..., Any]] | None:
    if inner is None or callable(inner):
        return inner
    if inner == "eager":
        return None
    if inner == "inductor":
        from torch._inductor.compile_fx import compile_fx

        # torch private API: compile_fx is a Dynamo backend, but its annotations are wider
        return compile_fx  # type: ignore[return-value]
    raise ConfigError(f"inner: expected 'eager', 'inductor' or a backend function, got {inner!r}")


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
        raise ConfigError(f"options: unknown key {sorted(unknown)[0]!r} (known: inner, pass_options, passes)")
    pipeline = resolve_pipeline(opts.get("passes"))
    backend = make_backend(pipeline, pass_options=opts.get("pass_options"), inner=opts.get("inner"))
    return backend(gm, example_inputs)
