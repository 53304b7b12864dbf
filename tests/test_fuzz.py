"""Fuzzing: random configs never escape as tracebacks; random graphs survive the full pipeline."""

from __future__ import annotations

import warnings

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import distopt
from distopt.config import from_dict
from distopt.errors import ConfigError
from distopt.passes.core.pass_base import resolve_pipeline
from distopt.report import report_of
from distopt.training.config import JobConfig

JOB_KEYS = [
    "model",
    "model_kwargs",
    "variant",
    "optimize",
    "parallel",
    "steps",
    "batch_size",
    "optim",
    "data",
    "eval",
    "device",
    "precision",
    "seed",
    "checkpoint_every",
    "resume",
    "ps",
    "num_threads",
    "bogus",
]
scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-3, 300),
    st.floats(allow_nan=True),
    st.sampled_from(["mlp", "dlrm", "ddp", "fsdp", "optimized", "x", ""]),
)
values = st.recursive(
    scalars,
    lambda c: (
        st.lists(c, max_size=3)
        | st.dictionaries(
            st.sampled_from(
                [
                    "latency_ms",
                    "num_servers",
                    "host",
                    "depth",
                    "junk",
                    "name",
                    "lr",
                    "source",
                    "every",
                    "kwargs",
                ]
            ),
            c,
            max_size=3,
        )
    ),
    max_leaves=5,
)


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.sampled_from(JOB_KEYS), values, max_size=6))
def test_fuzzed_job_configs_give_a_config_or_a_one_line_error(data) -> None:
    try:
        from_dict(JobConfig, data)
    except ConfigError as err:
        assert "\n" not in str(err) and str(err)


OPS = st.lists(
    st.tuples(
        st.sampled_from(["linear", "relu", "identity", "add", "mul", "cat_split"]),
        st.integers(0, 1000),
        st.integers(0, 1000),
    ),
    min_size=1,
    max_size=12,
)


class RandomDag(nn.Module):
    """Each step reads earlier values chosen by the drawn indices: a random DAG of dense ops."""

    def __init__(self, steps: list[tuple[str, int, int]]) -> None:
        super().__init__()
        self.steps = steps
        self.mods = nn.ModuleDict()
        for i, (kind, _, _) in enumerate(steps):
            if kind == "linear":
                self.mods[str(i)] = nn.Linear(4, 4)
            elif kind == "identity":
                self.mods[str(i)] = nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        values = [x]
        for i, (kind, a, b) in enumerate(self.steps):
            u, v = values[a % len(values)], values[b % len(values)]
            if kind in ("linear", "identity"):
                values.append(self.mods[str(i)](u))
            elif kind == "relu":
                values.append(torch.relu(u))
            elif kind == "add":
                values.append(u + v)
            elif kind == "mul":
                values.append(u * v)
            else:
                left, right = torch.cat([u, v], dim=1).split(4, dim=1)
                values.append(left - right)
        return values[-1] + values[len(values) // 2]


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(OPS)
def test_random_graphs_through_the_full_pipeline_stay_equivalent(steps) -> None:
    torch.manual_seed(0)
    model = RandomDag(steps)
    x = torch.randn(3, 4)
    passes = [spec.name for spec in resolve_pipeline(None)] + ["partition"]
    with warnings.catch_warnings():
        warnings.simplefilter("error", distopt.DistoptFallbackWarning)
        optimized = distopt.optimize(
            model,
            (x,),
            passes=passes,
            config={"pass_options": {"partition": {"num_units": 2}}},
            strict=True,
        )
    assert report_of(optimized).verification.passed
    assert list(optimized.state_dict()) == list(model.state_dict())
    torch.testing.assert_close(optimized(x), model(x))
    again = distopt.optimize(
        optimized,
        (x,),
        passes=passes,
        config={"pass_options": {"partition": {"num_units": 2}}},
        strict=True,
    )
    # Idempotent up to node names (DCE in the first run can shift the name counters).
    shape = [(n.op, str(n.target), len(n.args)) for n in optimized.graph.nodes]
    assert [(n.op, str(n.target), len(n.args)) for n in again.graph.nodes] == shape
