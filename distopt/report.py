"""What distopt.optimize did: capture tier, per-pass changes and timing, verification outcome."""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any

from torch import nn


@dataclass
class PassRecord:
    name: str
    modified: bool
    detail: str
    seconds: float
    nodes_before: int
    nodes_after: int
    nodes_changed: int
    """Nodes added, removed or moved (a diff of the node sequence)."""


@dataclass
class GraphRecord:
    """One captured graph (symbolic tracing gives one; Dynamo one per graph break)."""

    code_before: str
    code_after: str = ""
    passes: list[PassRecord] = field(default_factory=list)
    dce_removed: int = 0
    reorders_float: bool = False
    """A kept pass computes some of the math in another floating-point order (see
    :data:`distopt.passes.core.runner.REORDERS_FLOAT`)."""
    measured_seconds: float | None = None
    """Median seconds of one call of the final graph on the example inputs, when a measured pass
    timed it: a sample :func:`distopt.optimize`'s final check reuses."""


@dataclass
class VerifyRecord:
    passed: bool
    max_abs_diff: float
    rtol: float
    atol: float
    compared: int
    """Number of tensors compared (outputs plus gradients)."""
    message: str = ""
    culprit: str | None = None
    seconds: float = 0.0
    skipped: str | None = None
    """Why verification did not run (e.g. it would have applied remote writes)."""
    gradients: bool = True
    """Whether parameter gradients were compared (not for eval-mode models, ``check_grads``
    off, or a backward that sends remote writes)."""
    partial: str | None = None
    """Why gradients were not compared when they could have been (backward sends a remote write)."""
    reordered: bool = False
    """Compared with the reordered-arithmetic tolerances (``atol`` times each tensor's scale)."""


@dataclass
class ParallelRecord:
    """What :func:`distopt.parallelize` did after optimizing: the wrapper, its units, the time."""

    strategy: str
    units: int = 0
    unit_bytes: list[int] = field(default_factory=list)
    """Parameter bytes of each unit, in execution order."""
    schedule: Any = None
    """FSDP2: the :class:`~distopt.parallel.fsdp_schedule.FsdpSchedule` (units left to the root
    and kept from forward into backward)."""
    regions: int = 0
    """Repeated blocks compiled as regions (one compile per distinct structure and shape)."""
    compiled: str = ""
    """What ``compile=True`` compiled, in words (empty: nothing)."""
    optimize_seconds: float = 0.0
    materialize_seconds: float = 0.0
    wrap_seconds: float = 0.0


@dataclass
class PipelineRecord:
    """Set on the main stage of a pipeline (:func:`distopt.pipeline.pipeline_split`)."""

    slots: list[str]
    """Each prefetched issue with the user's source lines it serves."""
    prefetch_code: str
    """Generated code of the prefetch stage."""


@dataclass
class OptimizeReport:
    model: str
    tier: str
    reason: str | None = None
    graphs: list[GraphRecord] = field(default_factory=list)
    verification: VerifyRecord | None = None
    fallback: str | None = None
    """Set when the original model was returned, with the reason."""
    capture_seconds: float = 0.0
    total_seconds: float = 0.0
    pass_names: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    parallel: ParallelRecord | None = None
    """Set on the result of :func:`distopt.parallelize`."""
    pipeline: PipelineRecord | None = None
    """Set on the main stage of a pipeline."""
    speed: str | None = None
    """The optimized eval model timed against the original, and what was returned."""
    original_seconds: float | None = None
    """How long the original's inference run for verification took (a timing sample)."""
    guards: list[str] = field(default_factory=list)
    """Branches symbolic tracing took as the example inputs take them, each guarded in the
    graph (``file:line: `code` is True``): an input taking the other branch fails there."""
    backward_writes: list[str] = field(default_factory=list)
    """Remote writes the model's backward sends (as verification found them, described with
    their source lines): what a pipeline running reads ahead of backward cannot see."""

    @property
    def reorders_float(self) -> bool:
        return any(graph.reorders_float for graph in self.graphs)


_REPORTS: weakref.WeakKeyDictionary[nn.Module, OptimizeReport] = weakref.WeakKeyDictionary()


def attach(module: nn.Module, report: OptimizeReport) -> None:
    _REPORTS[module] = report


def report_of(module: nn.Module) -> OptimizeReport | None:
    return _REPORTS.get(module)
