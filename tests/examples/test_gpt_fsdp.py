"""examples/gpt_fsdp.py, run as its docstring says: FSDP2 + bf16 through distopt.parallelize on a
token file."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.examples.scripts import run_documented


@pytest.mark.slow
def test_gpt_gets_below_the_unigram_entropy(tmp_path: Path) -> None:
    proc = run_documented(
        "python", "examples/gpt_fsdp.py", "--tokens", "30000", "--steps", "60", "--out", tmp_path
    )
    found = re.search(
        r"held-out loss (\d+\.\d+) nats vs unigram entropy (\d+\.\d+) nats", proc.stdout
    )
    assert found is not None, proc.stdout
    loss, entropy = float(found.group(1)), float(found.group(2))
    assert loss < entropy - 1.0, (loss, entropy)  # about 1.4 nats against 3.8
