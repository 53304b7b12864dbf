"""The ``distopt`` Dynamo backend: run distopt's passes on each graph Dynamo captures.

``torch.compile(model, backend="distopt")`` finds it through the ``torch_dynamo_backends`` entry
point; :func:`distopt.optimize` uses :func:`make_backend` for its Dynamo capture tier.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch.fx

from distopt.errors import PassError
from distopt.passes import PassSpec, resolve_pipeline, run_passes
from distopt.report import GraphRecord, OptimizeReport


def make_backend(
    pipeline: Sequence[PassSpec],
    *,
    pass_options: dict[str, dict[str, Any]] | None = None,
    report: OptimizeReport | None = None,
    strict: bool = False,
    inner: Callable[[torch.fx.GraphModule, list[Any]], Callable[..., Any]] | None = None,
) -> Callable[[torch.fx.GraphModule, list[Any]], Callable[..., Any]]:
    """A Dynamo backend applying ``pipeline`` to every captured graph, then ``inner`` (or eager).

    A failing pass leaves that graph unoptimized (recorded in ``report``) unless ``strict``.
    """

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


def distopt_backend(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
    """``torch.compile(backend="distopt")``: the default passes on each graph, run eagerly."""
    return make_backend(resolve_pipeline(None))(gm, example_inputs)
