"""The estimation layer: what a graph costs, measured once and simulated, for passes and tools.

* :mod:`~distopt.estimate.profile` — the one node profiler (median of timed runs, user state
  untouched, remote reads timed or modeled, writes never sent);
* :mod:`~distopt.estimate.timeline` — one clock over a graph: blocking calls vs overlapped waits;
* :mod:`~distopt.estimate.predict` — before/after predictions of the remote-call scheduling
  passes (the tools' ``predict_gain``, which captures the model first, is
  :mod:`distopt.optimize.gain`, above this layer);
* :mod:`~distopt.estimate.collectives` — the α–β model of FSDP's collectives.
* :mod:`~distopt.estimate.step` — the whole training step phase by phase: what the trainer
  measures and what the model predicts, under the same names (docs/cost_model.md).
"""

from distopt.estimate.predict import (
    GainPrediction,
    Prediction,
    measure_latency,
    predict,
    staleness_to_hide,
)
from distopt.estimate.profile import profile_nodes
from distopt.estimate.step import StepPhases, StepPrediction, predict_step
from distopt.estimate.timeline import RequestLatency, Timeline, simulate

__all__ = [
    "GainPrediction",
    "Prediction",
    "RequestLatency",
    "StepPhases",
    "StepPrediction",
    "Timeline",
    "measure_latency",
    "predict",
    "predict_step",
    "profile_nodes",
    "simulate",
    "staleness_to_hide",
]
