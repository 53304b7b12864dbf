"""Cross-iteration prefetch: a model's remote reads for the next batches issued while the current
step trains (:class:`TrainPipeline`; ``pipeline:`` in a job config)."""

from distopt.pipeline.prefetch import PipelineStats, Prefetcher
from distopt.pipeline.slots import PipelineError, provided
from distopt.pipeline.split import PrefetchSplit, prefetchable, split_prefetch
from distopt.pipeline.train_pipeline import (
    StepOutput,
    TrainPipeline,
    check_pipelined,
    check_staleness,
    pipeline_split,
)

__all__ = [
    "PipelineError",
    "PipelineStats",
    "PrefetchSplit",
    "Prefetcher",
    "StepOutput",
    "TrainPipeline",
    "check_pipelined",
    "check_staleness",
    "pipeline_split",
    "prefetchable",
    "provided",
    "split_prefetch",
]
