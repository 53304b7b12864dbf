"""``torch.compile(model, backend="distopt")`` computes what eager computes on the example models."""

from __future__ import annotations

import shutil

import pytest
import torch
import torch._dynamo

from distopt.errors import ConfigError
from distopt.models import build, make_inputs
from distopt.optimize.backend import distopt_backend

MODELS = {
    "mlp": {},
    "cnn": {},
    "gpt": {"layers": 1, "dropout": 0.0},
    "resnet50": {"width": 4, "image_size": 32, "num_classes": 10, "blocks": (1, 1, 1, 1)},
}


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("mode", ["train", "eval"])
def test_backend_by_name_matches_eager(name: str, mode: str) -> None:
    model = build(name, **MODELS[name])
    model.train(mode == "train")
    inputs = make_inputs(name, model, 2)
    compiled = torch.compile(model, backend="distopt")
    out = compiled(*inputs)
    ref = model(*inputs)
    # Conv nets may get BatchNorm folded and channels-last kernels where those measure faster:
    # the same math summed in another order (verify.reordered_rtol/atol's defaults).
    tol = {"rtol": 1e-4, "atol": 1e-4} if name in ("cnn", "resnet50") else {}
    torch.testing.assert_close(out, ref, **tol)
    if mode == "train":
        out.sum().backward()
        grads = [p.grad.clone() for p in model.parameters()]
        model.zero_grad()
        ref.sum().backward()
        for got, want in zip(grads, (p.grad for p in model.parameters()), strict=True):
            torch.testing.assert_close(got, want, **tol)


@pytest.mark.skipif(
    shutil.which("g++") is None and shutil.which("gcc") is None,
    reason="inductor needs a C++ compiler",
)
def test_inner_inductor_matches_eager() -> None:
    model = build("mlp")
    (x,) = make_inputs("mlp", model, 4)
    compiled = torch.compile(model, backend="distopt", options={"inner": "inductor"})
    torch.testing.assert_close(compiled(x), model(x), rtol=1e-5, atol=1e-5)


def test_unknown_option_is_named() -> None:
    gm = torch.fx.symbolic_trace(build("mlp"))
    with pytest.raises(ConfigError, match="'fast'"):
        distopt_backend(gm, [], options={"fast": True})


def test_explain_reports_the_graphs_the_backend_compiled() -> None:
    import distopt

    model = build("control_flow")
    inputs = make_inputs("control_flow", model, 2)
    compiled = torch.compile(model, backend="distopt")
    compiled(*inputs)
    text = distopt.explain(compiled, show_code=False)
    assert "dynamo (torch.compile backend='distopt')" in text
    assert "graph 1/" in text and "remove_identity" in text
    assert "no graph compiled yet" not in text


def test_explain_before_the_first_call_says_so() -> None:
    import distopt

    compiled = torch.compile(build("mlp"), backend="distopt")
    assert "no graph compiled yet: call the module once" in distopt.explain(
        compiled, show_code=False
    )
