import pytest
import torch
from torch import nn

import distopt
from distopt import models
from distopt.errors import DistoptFallbackWarning
from distopt.optimize.explain import draw_graph, summary


def test_report_lists_tier_passes_diff_and_verification() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Identity(), nn.ReLU())
    optimized = distopt.optimize(model, (torch.randn(2, 4),))
    text = distopt.explain(optimized)
    assert "capture tier: symbolic_trace" in text
    assert "remove_identity" in text and "1 node " in text
    assert '-    _1 = getattr(self, "1")(_0)' in text or 'self, "1"' in text
    assert "verification passed" in text


def test_a_model_optimized_without_inputs_says_how_to_verify_it() -> None:
    """A user's trial: `verification: not run (no example_inputs)` said nothing of what to do."""
    optimized = distopt.optimize(nn.Sequential(nn.Linear(4, 4), nn.Identity()))
    text = " ".join(distopt.explain(optimized, show_code=False).split())
    assert "verification: not run (no example_inputs: pass them to distopt.optimize;" in text
    assert "returns (model, inputs)" in text


def test_fallback_report_names_reason() -> None:
    model = models.build("control_flow")
    result = distopt.optimize(model, config={"capture": {"dynamo": False}})
    text = distopt.explain(result, show_code=False)
    assert "returned unoptimized" in text and "control_flow.py" in text


def test_graph_picture_reports_missing_tools_or_writes_file(tmp_path) -> None:
    gm = distopt.optimize(nn.Linear(2, 2))
    warnings = draw_graph(gm, tmp_path / "g.svg")
    if warnings:
        assert "pydot" in warnings[0] or "Graphviz" in warnings[0]
    else:
        assert (tmp_path / "g.svg").read_bytes().startswith(b"<?xml")
    assert draw_graph(gm, tmp_path / "g.bmp") == [
        f"graph picture {tmp_path / 'g.bmp'}: unsupported format 'bmp' (use .svg, .png or .dot)"
    ]


def test_explain_rejects_foreign_modules() -> None:
    import pytest

    with pytest.raises(distopt.DistoptError) as err:
        distopt.explain(nn.Linear(2, 2))
    assert str(err.value) == (
        "Linear: not a module returned by distopt.optimize, distopt.parallelize "
        'or torch.compile(backend="distopt")'
    )


class Branchy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tables = nn.ModuleList([nn.Linear(2, 2)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tables[0](x)[0].sum() > 0:  # brackets the report must keep
            return x
        return -x


def test_source_excerpts_keep_their_brackets() -> None:
    result = distopt.optimize(Branchy(), config={"capture": {"dynamo": False}})
    text = distopt.explain(result, show_code=False)
    assert "if self.tables[0](x)[0].sum() > 0:" in text


def test_explain_reports_what_parallelize_did() -> None:
    import torch.distributed as dist

    from distopt.dist import rendezvous

    plan = rendezvous.StorePlan(host="127.0.0.1", hosted_by="trainer0", gloo_port=0)
    hosted = rendezvous.host_stores(plan, me="trainer0", timeout_s=30)  # loopback only
    rendezvous.init_gloo(hosted.plan, me="trainer0", rank=0, world_size=1, timeout_s=30)
    try:
        model = models.build("gpt", layers=2, dropout=0.0)
        inputs = models.make_inputs("gpt", model, 2)
        wrapped = distopt.parallelize(model, "fsdp", example_inputs=inputs, min_unit_bytes=0)
        text = distopt.explain(wrapped, show_code=False)
    finally:
        dist.destroy_process_group()
        hosted.close()
    assert "capture tier: symbolic_trace" in text and "verification passed" in text
    assert "parallelize: fsdp, 4 units (MiB: " in text
    assert "FSDP2 schedule: units left to the root" in text


class _Counting(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.calls = 0
        self.inner = nn.Sequential(nn.Linear(4, 4), nn.Identity())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.inner(x)


def test_a_job_logs_summary_of_a_fallback_gives_the_reason_and_no_changes() -> None:
    """A user's trial: 'returned unoptimized (eager_fallback; changed by split_remote, ...)'
    named passes whose changes were thrown away."""
    with pytest.warns(DistoptFallbackWarning):
        result = distopt.optimize(_Counting(), (torch.randn(2, 4),))
    line = summary(result)
    assert line.startswith("optimize: _Counting returned unoptimized (eager_fallback): ")
    assert "changed by" not in line and "forward assigns calls" in line
