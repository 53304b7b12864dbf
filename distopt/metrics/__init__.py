"""Throughput logs and run comparison: QPS JSON Lines logs (:mod:`.qps_log`) and the statistics
behind ``distopt compare`` (:mod:`.compare`)."""

from distopt.metrics.compare import CompareError, Comparison, Gain, RunSummary, compare_runs
from distopt.metrics.qps_log import (
    EvalRecord,
    MergedStep,
    QpsLogError,
    QpsLogWriter,
    RankLog,
    RunLog,
    StepRecord,
    load_run,
    log_path,
    read_log,
)

__all__ = [
    "CompareError",
    "EvalRecord",
    "Comparison",
    "Gain",
    "MergedStep",
    "QpsLogError",
    "QpsLogWriter",
    "RankLog",
    "RunLog",
    "RunSummary",
    "StepRecord",
    "compare_runs",
    "load_run",
    "log_path",
    "read_log",
]
