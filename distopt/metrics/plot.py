"""The ``distopt compare --plot`` figure: QPS over steps per run, and a box plot per run."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

from distopt.errors import DistoptError
from distopt.metrics.compare import Comparison, shown_label


def jobs_apart(steps: Sequence[int], qps: Sequence[float]) -> tuple[list[float], list[float]]:
    """A pooled run's steps and QPS with a gap (NaN, where matplotlib breaks a line) wherever
    the step number does not increase: each job's line ends at its last step instead of being
    drawn back to the next job's first."""
    xs: list[float] = []
    ys: list[float] = []
    for i, (step, value) in enumerate(zip(steps, qps, strict=True)):
        if i and step <= steps[i - 1]:
            xs.append(math.nan)
            ys.append(math.nan)
        xs.append(step)
        ys.append(value)
    return xs, ys


def plot_comparison(comparison: Comparison, path: str | Path) -> Path:
    """Write a PNG (or any format matplotlib infers from the suffix) and return its path."""
    try:  # matplotlib is optional (distopt[plot]) and slow to import: only when plotting
        # A Figure without pyplot draws with Agg and leaves the process's backend as it was.
        from matplotlib.figure import Figure
        from matplotlib.ticker import MaxNLocator
    except ImportError:
        raise DistoptError("--plot needs matplotlib: pip install 'distopt[plot]'") from None

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig = Figure(figsize=(12, 4.5), constrained_layout=True)
    ax_line, ax_box = fig.subplots(1, 2, gridspec_kw={"width_ratios": [2, 1]})
    names = [
        f"{i + 1}: {run.variant} ({shown_label(run.label, short=True)})"
        for i, run in enumerate(comparison.runs)
    ]
    for run, name in zip(comparison.runs, names, strict=True):
        ax_line.plot(*jobs_apart(run.step_numbers, run.qps), label=name, linewidth=1.2)
    if comparison.warmup:
        # Shade up to halfway to the first measured step so the boundary is unambiguous.
        ax_line.axvspan(
            min(run.step_numbers[0] for run in comparison.runs),
            min(run.step_numbers[run.warmup] for run in comparison.runs) - 0.5,
            color="grey",
            alpha=0.15,
            label=f"warm-up ({comparison.warmup} steps, excluded)",
        )
    ax_line.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax_line.set_xlabel("step")
    ax_line.set_ylabel("QPS (samples/s, all trainers)")
    ax_line.set_title("Throughput per step")
    ax_line.grid(True, alpha=0.3)
    ax_line.legend(loc="best", fontsize="small")

    gains = {g.label: g for g in comparison.gains}
    # Run ids are in the line plot's legend; the box labels stay short so they never overlap.
    box_names = [
        f"{index + 1}: {run.variant}"
        + ("\nbaseline" if run.label not in gains else f"\ngain ×{gains[run.label].median:.3f}")
        for index, run in enumerate(comparison.runs)
    ]
    ax_box.boxplot(
        [run.measured_qps for run in comparison.runs],
        whis=(10, 90),  # whiskers at p10/p90, matching the table
        showfliers=True,
        flierprops={"markersize": 3, "alpha": 0.5},
    )
    ax_box.set_xticks(range(1, len(names) + 1), box_names, fontsize="small")
    ax_box.set_ylabel("QPS after warm-up (samples/s)")
    ax_box.set_title("QPS distribution (whiskers p10–p90)")
    ax_box.grid(True, axis="y", alpha=0.3)
    fig.suptitle("distopt compare: " + " vs ".join(run.variant for run in comparison.runs))
    fig.savefig(path, dpi=120)
    return path
