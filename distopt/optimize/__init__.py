"""``distopt.optimize``: capture a model, run the pass pipeline, verify it, and report."""

from distopt.optimize.api import optimize
from distopt.optimize.explain import explain

__all__ = ["explain", "optimize"]
