"""``distopt.explain``: a readable account of what ``distopt.optimize`` did to a model."""

from __future__ import annotations

import difflib
import io
import shutil
from pathlib import Path
from typing import cast

import torch.fx
from rich.console import Console
from rich.markup import escape
from rich.syntax import Syntax
from rich.table import Table
from torch import nn

from distopt.errors import DistoptError
from distopt.report import OptimizeReport, ParallelRecord, report_of


def draw_graph(gm: torch.fx.GraphModule, path: str | Path) -> list[str]:
    """Write a picture of ``gm``'s graph; return warnings (empty on success) instead of raising."""
    path = Path(path)
    suffix = path.suffix.lstrip(".").lower()
    if suffix not in ("svg", "png", "dot"):
        return [f"graph picture {path}: unsupported format {suffix!r} (use .svg, .png or .dot)"]
    try:
        from torch.fx.passes.graph_drawer import FxGraphDrawer

        dot = FxGraphDrawer(gm, type(gm).__name__).get_dot_graph()
    except (ImportError, RuntimeError) as err:
        return [f"graph picture {path}: needs pydot (pip install pydot): {err}"]
    if suffix != "dot" and shutil.which("dot") is None:
        return [f"graph picture {path}: needs Graphviz's `dot` on PATH (apt-get install graphviz)"]
    path.parent.mkdir(parents=True, exist_ok=True)
    # pydot annotates Dot.create as returning str, but it returns the image bytes.
    data = cast(bytes, dot.create(format=suffix)) if suffix != "dot" else dot.to_string().encode()
    path.write_bytes(data)
    return []


def code_diff(before: str, after: str) -> str:
    lines = difflib.unified_diff(
        before.strip().splitlines(), after.strip().splitlines(), "before", "after", lineterm="", n=2
    )
    return "\n".join(lines)


def render(report: OptimizeReport, *, show_code: bool = True, console: Console) -> None:
    verdict = "optimized" if report.fallback is None else "returned unoptimized"
    # Everything taken from the user's code (source lines such as ``ps.fetch(self.tables[k], ids)``,
    # error messages, pass details) is escaped: rich would read ``[k]`` as markup and drop it.
    console.print(f"[bold]distopt[/bold] {escape(report.model)}: {verdict}")
    console.print(f"  capture tier: [cyan]{escape(report.tier)}[/cyan]")
    if report.reason:
        console.print(f"  note: {escape(report.reason)}")
    if report.fallback:
        console.print(f"  [red]fallback:[/red] {escape(report.fallback)}")
    console.print(
        f"  capture {report.capture_seconds * 1e3:.1f} ms, total {report.total_seconds * 1e3:.1f} ms, "
        f"passes: {', '.join(report.pass_names) or 'none'}"
    )
    for index, graph in enumerate(report.graphs):
        table = Table(title=f"graph {index + 1}/{len(report.graphs)}", title_justify="left")
        for column in ("pass", "changed", "nodes", "time (ms)", "detail"):
            table.add_column(column, justify="right" if column in ("nodes", "time (ms)") else "left")
        for rec in graph.passes:
            table.add_row(
                escape(rec.name),
                f"{rec.nodes_changed} nodes" if rec.modified else "no",
                f"{rec.nodes_before}→{rec.nodes_after}",
                f"{rec.seconds * 1e3:.2f}",
                escape(rec.detail),
            )
        console.print(table)
        if show_code and graph.code_after:
            diff = code_diff(graph.code_before, graph.code_after)
            if diff:
                console.print(Syntax(diff, "diff", word_wrap=True))
            else:
                console.print("  generated code unchanged by the passes")
    for warning in report.warnings:
        console.print(f"  [yellow]warning:[/yellow] {escape(warning)}")
    if report.speed:
        console.print(f"  speed: {escape(report.speed)}")
    if report.parallel is not None:
        _render_parallel(report.parallel, console)
    if report.pipeline is not None:
        console.print(f"  pipeline: {len(report.pipeline.slots)} read(s) prefetched a step ahead")
        for slot, line in enumerate(report.pipeline.slots):
            console.print(f"    slot {slot}: {escape(line)}")
        if show_code:
            console.print("  prefetch stage:")
            console.print(Syntax(report.pipeline.prefetch_code.strip(), "python", word_wrap=True))
    v = report.verification
    if v is not None and v.skipped:
        console.print(f"  verification [yellow]skipped[/yellow]: {escape(v.skipped)}")
    elif v is not None:
        status = "[green]passed[/green]" if v.passed else "[red]FAILED[/red]"
        console.print(
            f"  verification {status}: {v.compared} tensors (outputs + grads), max abs diff "
            f"{v.max_abs_diff:.3g}, rtol={v.rtol:g} atol={v.atol:g}{'×scale (reordered arithmetic)' * v.reordered}, "
            f"{v.seconds * 1e3:.0f} ms"
            + (f"; {escape(v.message)}" if v.message else "")
            + (f"; culprit pass: {v.culprit}" if v.culprit else "")
        )
    elif report.fallback is None:
        console.print("  verification: not run (no example_inputs)")


def _render_parallel(record: ParallelRecord, console: Console) -> None:
    sizes = ", ".join(f"{b / 2**20:.2f}" for b in record.unit_bytes) or "none"
    console.print(f"  parallelize: [cyan]{record.strategy}[/cyan], {record.units} units (MiB: {sizes})")
    schedule = record.schedule
    if schedule is not None:
        console.print(
            f"  FSDP2 schedule: units left to the root {sorted(schedule.root_held) or 'none'}, "
            f"kept from forward into backward {sorted(schedule.keep_after_forward) or 'none'}; "
            f"{schedule.gathered_bytes / 2**20:.1f} MiB gathered per step, "
            f"{schedule.memory_bytes / 2**20:.1f} MiB parameter peak per rank"
        )
    if record.regions:
        console.print(f"  regional compile: {record.regions} repeated blocks, compiled once per distinct structure")
    console.print(
        f"  parallelize time: optimize {record.optimize_seconds * 1e3:.0f} ms, units "
        f"{record.materialize_seconds * 1e3:.0f} ms, wrap {record.wrap_seconds * 1e3:.0f} ms"
    )


def _report(module: nn.Module) -> OptimizeReport:
    """The report of ``module``: from distopt.optimize or distopt.parallelize, or gathered from the
    graphs the ``distopt`` backend compiled for a ``torch.compile(backend="distopt")`` module."""
    report = report_of(module)
    if report is not None:
        return report
    from distopt.compile_backend import compiled_report

    report = compiled_report(module)
    if report is None:
        raise DistoptError(
            f"{type(module).__name__}: not a module returned by distopt.optimize, distopt.parallelize "
            'or torch.compile(backend="distopt")'
        )
    return report


def explain(
    module: nn.Module,
    *,
    show_code: bool = True,
    graph_path: str | Path | None = None,
    console: Console | None = None,
) -> str:
    """Print (and return) the report of ``distopt.optimize`` for ``module``.

    Args:
        module: a module returned by :func:`distopt.optimize` or :func:`distopt.parallelize`, or
            ``torch.compile(model, backend="distopt")`` after its first call.
        show_code: include the generated-code diff of each graph.
        graph_path: also write a picture of the graph (``.svg``/``.png``/``.dot``).
    """
    report = _report(module)
    if graph_path is not None and isinstance(module, torch.fx.GraphModule):
        report.warnings.extend(draw_graph(module, graph_path))
    buffer = io.StringIO()
    capture = Console(file=buffer, width=110, force_terminal=False, color_system=None)
    render(report, show_code=show_code, console=capture)
    text = buffer.getvalue()
    (console or Console()).print(text, end="", markup=False, highlight=False, soft_wrap=True)
    return text
