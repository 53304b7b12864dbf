"""Model capture: symbolic tracing → Dynamo → untouched model (see :func:`distopt.optimize`)."""

from distopt.capture.frontend import (
    CaptureResult,
    Tier,
    describe_failure,
    dynamo_capture,
    keep_state_names,
    symbolic_capture,
)
from distopt.capture.tracer import DistoptTracer, resolve_qualname

__all__ = [
    "CaptureResult",
    "DistoptTracer",
    "Tier",
    "describe_failure",
    "dynamo_capture",
    "keep_state_names",
    "resolve_qualname",
    "symbolic_capture",
]
