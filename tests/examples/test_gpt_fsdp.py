"""examples/gpt_fsdp.py, small: FSDP2 + bf16 through distopt.parallelize on a token file."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.examples.test_dlrm_criteo import ROOT, load_example


@pytest.mark.slow
def test_gpt_gets_below_the_unigram_entropy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    loss, entropy = load_example("examples/gpt_fsdp.py").run(num_tokens=30_000, steps=60, out=tmp_path)
    assert loss < entropy - 1.0, (loss, entropy)  # about 1.4 nats against 3.8
