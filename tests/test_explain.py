import torch
from torch import nn

import distopt
from distopt import models
from distopt.explain import draw_graph


def test_report_lists_tier_passes_diff_and_verification() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Identity(), nn.ReLU())
    optimized = distopt.optimize(model, (torch.randn(2, 4),))
    text = distopt.explain(optimized)
    assert "capture tier: symbolic_trace" in text
    assert "remove_identity" in text and "1 nodes" in text
    assert "-    _1 = getattr(self, \"1\")(_0)" in text or "self, \"1\"" in text
    assert "verification passed" in text


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
    assert draw_graph(gm, tmp_path / "g.bmp") == [f"graph picture {tmp_path / 'g.bmp'}: unsupported format 'bmp' (use .svg, .png or .dot)"]


def test_explain_rejects_foreign_modules() -> None:
    import pytest

    with pytest.raises(distopt.DistoptError, match="not a module returned by distopt.optimize"):
        distopt.explain(nn.Linear(2, 2))
