"""Synthetic batches as a data source (distopt.data.synthetic)."""

from __future__ import annotations

import itertools

import torch

from distopt import models
from distopt.data.loader import build_loader
from distopt.data.synthetic import SyntheticBatches, batch_seed
from distopt.models.ids import fit_zipf_alpha, id_counts


def test_batches_are_todays_make_inputs_cycled_per_rank() -> None:
    model = models.build("mlp")
    data = SyntheticBatches("mlp", model, batch_size=5, num_batches=3, seed=2)
    expected = models.make_inputs("mlp", model, 5, seed=batch_seed(2, 1, 1))
    assert batch_seed(2, 1, 1) == 2 * 100_003 + 1009 + 1
    assert torch.equal(data.item(1, 1).inputs[0], expected[0])
    assert data.item(1, 4) is data.item(1, 1)  # index 4 is distinct batch 4 % 3, made once
    assert data.item(1, 1).targets is None
    assert not torch.equal(data.item(0, 1).inputs[0], data.item(1, 1).inputs[0])


def test_loader_yields_whole_batches_and_resumes() -> None:
    model = models.build("mlp")

    def firsts(start: int, workers: int = 0) -> list[float]:
        data = SyntheticBatches("mlp", model, batch_size=4, num_batches=3, seed=0)
        loader = build_loader(data, rank=0, world_size=1, batch_size=None, num_workers=workers)
        return [float(b.inputs[0][0, 0]) for b in itertools.islice(loader.batches(start), 5)]

    plain = firsts(0)
    assert plain[3] == plain[0] and len(set(plain[:3])) == 3
    assert firsts(2) == [plain[i % 3] for i in range(2, 7)]
    assert firsts(0, workers=2) == plain


def test_dlrm_batches_are_zipf_with_model_kwarg_id_alpha() -> None:
    # What a job with `model: dlrm` and `model_kwargs: {id_alpha: 1.05}` reads from the
    # synthetic source: the model's own inputs, its ids drawn Zipf(1.05).
    model = models.build("dlrm", num_rows=2000, id_alpha=1.05)
    data = SyntheticBatches("dlrm", model, batch_size=4096, num_batches=2, seed=0)
    _, sparse = data.item(0, 0).inputs
    assert sparse.shape == (4, 4096, 4) and int(sparse.max()) < 2000
    assert abs(fit_zipf_alpha(id_counts(sparse)) - 1.05) < 0.05
    uniform = SyntheticBatches("dlrm", models.build("dlrm", num_rows=2000), batch_size=4096)
    # Uniform ids fit about 0.14: ranking 65k draws by count orders sampling noise.
    assert fit_zipf_alpha(id_counts(uniform.item(0, 0).inputs[1])) < 0.3
