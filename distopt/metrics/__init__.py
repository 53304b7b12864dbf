"""Throughput logs and run comparison: QPS JSON Lines logs (:mod:`.qps_log`, records in :mod:`.records`) and the statistics
behind ``distopt compare`` (:mod:`.compare`)."""

from distopt.metrics.compare import CompareError, Comparison, Gain, RunSummary, compare_runs
from distopt.metrics.qps_log import QpsLogWriter, load_run, read_log
from distopt.metrics.records import (
    EvalRecord,
    MergedStep,
    QpsLogError,
    RankLog,
    RunLog,
    StepRecord,
    log_path,
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
