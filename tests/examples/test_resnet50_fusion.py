"""examples/resnet50_fusion.py, run as its docstring says: folding and channels-last, explained."""

from __future__ import annotations

import re

import pytest

from tests.examples.scripts import run_documented


@pytest.mark.slow
def test_resnet_is_folded_verified_and_timed() -> None:
    proc = run_documented("python", "examples/resnet50_fusion.py")
    assert "distopt ResNet" in proc.stdout and ": optimized" in proc.stdout
    assert re.search(r"fold_conv_bn +│ \d+ nodes", proc.stdout)
    assert "verification passed (outputs only)" in proc.stdout  # an eval-mode model: no gradients
    assert re.search(r"eager [\d.]+ ms, distopt [\d.]+ ms \([\d.]+×\)", proc.stdout)
