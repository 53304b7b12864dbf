import warnings

import pytest
import torch
import torch.fx
from torch import nn

import distopt
from distopt import models
from distopt.errors import ConfigError, VerificationError
from distopt.passes import PassResult, register_pass, unregister_pass
from distopt.report import report_of

EXAMPLES = ["mlp", "cnn", "gpt", "control_flow"]


def _build(name: str) -> tuple[nn.Module, tuple]:
    torch.manual_seed(0)
    model = models.build(name)
    return model, models.make_inputs(name, model, 4)


def _outputs_and_grads(model: nn.Module, inputs: tuple) -> tuple[torch.Tensor, dict]:
    torch.manual_seed(1)  # dropout draws the same masks in both runs
    for p in model.parameters():
        p.grad = None
    out = model(*inputs)
    out.float().pow(2).mean().backward()
    return out.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("name", EXAMPLES)
def test_outputs_and_gradients_match_original(name: str) -> None:
    model, inputs = _build(name)
    with warnings.catch_warnings():
        warnings.simplefilter("error", distopt.DistoptFallbackWarning)
        optimized = distopt.optimize(model, inputs)
    report = report_of(optimized)
    assert report is not None and report.verification is not None and report.verification.passed
    # An independent check, outside the optimizer's own verification.
    ref_out, ref_grads = _outputs_and_grads(model, inputs)
    opt_out, opt_grads = _outputs_and_grads(optimized, inputs)
    torch.testing.assert_close(opt_out, ref_out, rtol=1e-5, atol=1e-6)
    assert ref_grads.keys() == opt_grads.keys()
    for key in ref_grads:
        torch.testing.assert_close(opt_grads[key], ref_grads[key], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", EXAMPLES)
def test_state_dict_keys_identical(name: str) -> None:
    model, inputs = _build(name)
    optimized = distopt.optimize(model, inputs)
    assert list(optimized.state_dict().keys()) == list(model.state_dict().keys())


@pytest.mark.parametrize("name,tier", [("mlp", "symbolic_trace"), ("cnn", "symbolic_trace"),
                                       ("gpt", "symbolic_trace"), ("control_flow", "dynamo")])
def test_capture_tier(name: str, tier: str) -> None:
    model, inputs = _build(name)
    assert report_of(distopt.optimize(model, inputs)).tier == tier


@pytest.fixture
def wrong_pass():
    @register_pass("test_wrong_scale", default=False)
    def wrong_scale(gm: torch.fx.GraphModule, ctx) -> PassResult:
        """Deliberately wrong: multiplies the output by 1.01."""
        output = next(n for n in gm.graph.nodes if n.op == "output")
        value = output.args[0]
        with gm.graph.inserting_before(output):
            scaled = gm.graph.call_function(torch.mul, (value, 1.01))
        output.args = (scaled,)
        return PassResult(modified=True)

    yield "test_wrong_scale"
    unregister_pass("test_wrong_scale")


def test_wrong_pass_is_caught_and_named(wrong_pass: str) -> None:
    model, inputs = _build("mlp")
    with pytest.warns(distopt.DistoptFallbackWarning, match=f"pass '{wrong_pass}' broke equivalence"):
        result = distopt.optimize(model, inputs, passes=["remove_identity", wrong_pass])
    assert result is model
    assert report_of(model).verification.culprit == wrong_pass


def test_wrong_pass_raises_under_strict(wrong_pass: str) -> None:
    model, inputs = _build("mlp")
    with pytest.raises(VerificationError, match=wrong_pass) as err:
        distopt.optimize(model, inputs, passes=[wrong_pass, "remove_identity"], strict=True)
    assert err.value.culprit == wrong_pass


@pytest.mark.parametrize("name", ["mlp", "cnn", "gpt"])
def test_optimizing_twice_and_retracing_is_idempotent(name: str) -> None:
    model, inputs = _build(name)
    once = distopt.optimize(model, inputs)
    twice = distopt.optimize(once, inputs)
    assert twice.code == once.code
    retraced = torch.fx.symbolic_trace(once)
    torch.testing.assert_close(retraced(*inputs), once(*inputs)) if name != "gpt" else None
    assert list(twice.state_dict()) == list(model.state_dict())


def test_no_inputs_means_no_verification() -> None:
    model, _ = _build("mlp")
    optimized = distopt.optimize(model)
    assert report_of(optimized).verification is None


@pytest.mark.parametrize(
    "call,match",
    [
        (lambda: distopt.optimize([nn.Linear(2, 2)]), "model: expected a torch.nn.Module, got list"),
        (lambda: distopt.optimize(nn.Linear(2, 2), (torch.randn(1, 2), torch.randn(1, 2))),
         r"example_inputs: Linear.forward takes 1 positional input\(s\), got 2"),
        (lambda: distopt.optimize(nn.Linear(2, 2), "x"), "example_inputs: expected a tensor"),
        (lambda: distopt.optimize(nn.Linear(2, 2), passes=["nope"]), "unknown pass 'nope'"),
        (lambda: distopt.optimize(nn.Linear(2, 2), passes="remove_identity"), "expected a list of pass names"),
        (lambda: distopt.optimize(nn.Linear(2, 2), config={"verify": {"rtol": -1}}), "verify.rtol: expected a number >= 0, got -1"),
        (lambda: distopt.optimize(nn.Linear(2, 2), config={"verfy": {}}), "config.verfy: unknown key"),
        (lambda: distopt.optimize(nn.Linear(2, 2), config={"capture": {"dynamo": "yes"}}), "config.capture.dynamo: expected true or false, got 'yes'"),
        (lambda: distopt.optimize(nn.Linear(2, 2), verify=True), "verify=True needs example_inputs"),
        (lambda: distopt.optimize(nn.Linear(2, 2), config={"pass_options": {"nope": {}}}), "pass_options: 'nope'"),
    ],
)
def test_bad_input_is_a_one_line_error(call, match: str) -> None:
    with pytest.raises(ConfigError, match=match) as err:
        call()
    assert "\n" not in str(err.value)
