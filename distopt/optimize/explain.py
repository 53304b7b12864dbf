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
from rich.table import Table
from rich.text import Text
from torch import nn
from torch.fx.passes.graph_drawer import FxGraphDrawer

from distopt.errors import DistoptError
from distopt.optimize.backend import compiled_report
from distopt.report import OptimizeReport, ParallelRecord, VerifyRecord, report_of
from distopt.text import plural


def draw_graph(gm: torch.fx.GraphModule, path: str | Path) -> list[str]:
    """Write a picture of ``gm``'s graph; return warnings (empty on success) instead of raising."""
    path = Path(path)
    suffix = path.suffix.lstrip(".").lower()
    if suffix not in ("svg", "png", "dot"):
        return [f"graph picture {path}: unsupported format {suffix!r} (use .svg, .png or .dot)"]
    try:
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


_DIFF_STYLES = {"+": "green", "-": "red", "@": "cyan"}


def _print_code(code: str, console: Console, *, diff: bool) -> None:
    """Generated code, one line per line: never wrapped inside an expression nor padded (on a
    terminal the terminal wraps long lines; elsewhere they stay whole)."""
    for line in code.splitlines():
        style = (
            _DIFF_STYLES.get(line[:1], "") if diff and not line.startswith(("+++", "---")) else ""
        )
        console.print(
            Text(line.rstrip(), style=style), soft_wrap=True
        )  # a blank context line is ' '


def changed_passes(report: OptimizeReport) -> list[str]:
    """The passes that changed a graph, in the order they ran (each once)."""
    return list(dict.fromkeys(r.name for g in report.graphs for r in g.passes if r.modified))


def _verdict(report: OptimizeReport) -> str:
    if report.fallback is not None:
        return "returned unoptimized"
    if not report.graphs:
        return "compiled; graphs are captured on its first call"
    if changed_passes(report):
        return "optimized"
    return "captured, unchanged: no pass changed the graph"


def _verification(v: VerifyRecord) -> str:
    """One line: what the check compared and found, or why it did not run."""
    if v.skipped:
        return f"verification skipped: {v.skipped}"
    what = "outputs and gradients" if v.gradients else "outputs only"
    status = "passed" if v.passed else "FAILED"
    text = (
        f"verification {status} ({what}): {plural(v.compared, 'tensor')} compared, max abs diff "
        f"{v.max_abs_diff:.3g}, rtol={v.rtol:g} atol={v.atol:g}"
        f"{'×scale (reordered arithmetic)' if v.reordered else ''}, {v.seconds * 1e3:.0f} ms"
    )
    text += f"; {v.message}" if v.message else ""
    text += f"; culprit pass: {v.culprit}" if v.culprit else ""
    return text + (f"; {v.partial}" if v.partial else "")


def summary(module: nn.Module) -> str:
    """One line on what :func:`distopt.optimize` did to ``module`` (job logs)."""
    report = _report(module)
    changed = [] if report.fallback else changed_passes(report)  # a fallback kept no change
    text = f"optimize: {report.model} {_verdict(report)} ({report.tier}"
    text += f"; changed by {', '.join(changed)})" if changed else ")"
    if report.fallback:
        return f"{text}: {report.fallback}"
    if report.verification is not None:
        return f"{text}; {_verification(report.verification)}"
    return f"{text}; not verified (no example inputs)"


def render(report: OptimizeReport, *, show_code: bool = True, console: Console) -> None:
    # Everything taken from the user's code (source lines such as ``ps.fetch(self.tables[k], ids)``,
    # error messages, pass details) is escaped: rich would read ``[k]`` as markup and drop it.
    console.print(f"[bold]distopt[/bold] {escape(report.model)}: {_verdict(report)}")
    console.print(f"  capture tier: [cyan]{escape(report.tier)}[/cyan]")
    if report.reason:
        console.print(f"  note: {escape(report.reason)}")
    if report.fallback:
        console.print(f"  [red]fallback:[/red] {escape(report.fallback)}")
    if report.guards:
        console.print(
            f"  {plural(len(report.guards), 'branch', 'branches')} taken as the example inputs "
            "take them, each guarded (an input taking the other branch fails there):"
        )
        for guard in report.guards:
            console.print(f"    {escape(guard)}")
    console.print(
        f"  capture {report.capture_seconds * 1e3:.1f} ms, total {report.total_seconds * 1e3:.1f} ms, "
        f"passes: {', '.join(report.pass_names) or 'none'}"
    )
    for index, graph in enumerate(report.graphs):
        console.print(f"graph {index + 1}/{len(report.graphs)}")
        table = Table()
        for column in ("pass", "changed", "nodes", "time (ms)", "detail"):
            table.add_column(
                column, justify="right" if column in ("nodes", "time (ms)") else "left"
            )
        for rec in graph.passes:
            table.add_row(
                escape(rec.name),
                plural(rec.nodes_changed, "node") if rec.modified else "no",
                f"{rec.nodes_before}→{rec.nodes_after}",
                f"{rec.seconds * 1e3:.2f}",
                escape(rec.detail),
            )
        console.print(table)
        if show_code and graph.code_after:
            diff = code_diff(graph.code_before, graph.code_after)
            if diff:
                _print_code(diff, console, diff=True)
            else:
                console.print("  generated code unchanged by the passes")
    for warning in report.warnings:
        console.print(f"  [yellow]warning:[/yellow] {escape(warning)}")
    if report.speed:
        console.print(f"  speed: {escape(report.speed)}")
    if report.parallel is not None:
        _render_parallel(report.parallel, console)
    if report.pipeline is not None:
        console.print(
            f"  pipeline: {plural(len(report.pipeline.slots), 'read')} prefetched a step ahead"
        )
        for slot, line in enumerate(report.pipeline.slots):
            console.print(f"    slot {slot}: {escape(line)}")
        if show_code:
            console.print("  prefetch stage:")
            _print_code(report.pipeline.prefetch_code.strip(), console, diff=False)
    v = report.verification
    if v is not None:
        color = "yellow" if v.skipped or v.partial else ("green" if v.passed else "red")
        head, _, rest = _verification(v).partition(": ")
        console.print(f"  [{color}]{escape(head)}[/{color}]: {escape(rest)}")
    elif report.fallback is None:
        console.print(
            "  verification: not run (no example_inputs: pass them to distopt.optimize; a factory "
            "for `distopt explain` returns (model, inputs), or the model has "
            "example_inputs(batch_size, seed))"
        )


def _render_parallel(record: ParallelRecord, console: Console) -> None:
    if record.units:
        sizes = ", ".join(f"{b / 2**20:.2f}" for b in record.unit_bytes)
        console.print(
            f"  parallelize: [cyan]{record.strategy}[/cyan], {record.units} units (MiB: {sizes})"
        )
    else:
        console.print(
            f"  parallelize: [cyan]{record.strategy}[/cyan], the whole module as one "
            + ("replica per rank" if record.strategy == "ddp" else "unit")
        )
    schedule = record.schedule
    if schedule is not None:
        console.print(
            f"  FSDP2 schedule: units left to the root {sorted(schedule.root_held) or 'none'}, "
            f"kept from forward into backward {sorted(schedule.keep_after_forward) or 'none'}, "
            f"not gathered in backward {sorted(schedule.backward_free) or 'none'}; "
            f"{schedule.gathered_bytes / 2**20:.1f} MiB gathered per step, "
            f"{schedule.memory_bytes / 2**20:.1f} MiB parameter peak per rank"
        )
    if record.compiled:
        console.print(
            f"  compile: {record.compiled}; Dynamo compiles on the first call (that step's "
            "time, not the times below)",
            markup=False,
        )
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
    out = console or Console()
    # The text returned, and printed where the output is not a terminal (a file, a pipe, a CI
    # log): no colour, no line wrapped or padded to a width; on a terminal, its width and colours.
    buffer = io.StringIO()
    plain = Console(
        file=buffer, width=_UNWRAPPED, force_terminal=False, color_system=None, soft_wrap=True
    )
    render(report, show_code=show_code, console=plain)
    text = buffer.getvalue()
    if out.is_terminal:
        render(report, show_code=show_code, console=out)
    else:
        out.print(text, end="", markup=False, highlight=False, soft_wrap=True)
    return text


_UNWRAPPED = 1 << 20
"""Console width of plain output: wider than any line, so none is wrapped (tables keep their
natural width, since they are not expanded)."""
