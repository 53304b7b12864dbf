"""Symbolic tracing with example inputs: branches on shapes taken and guarded, model untouched."""

import dataclasses
import functools
from typing import Any

import pytest
import torch
import torch.fx
from torch import nn

import distopt
from distopt.capture import symbolic_capture
from distopt.config import CaptureConfig
from distopt.report import report_of


class ChecksChannels(nn.Module):
    """transformers' ResNet embeddings check the channel count before the stem."""

    def __init__(self, channels: int = 3) -> None:
        super().__init__()
        self.channels = channels
        self.conv = nn.Conv2d(channels, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[1] != self.channels:
            raise ValueError("channel dimension does not match the configuration")
        y = torch.relu(self.bn(self.conv(x)))
        if y.dim() == 4:  # a branch taken as True
            y = y.mean(dim=(2, 3))
        return y


def test_a_branch_on_a_shape_is_taken_as_the_example_takes_it_and_guarded() -> None:
    model = ChecksChannels().eval()
    x = torch.randn(2, 3, 8, 8)
    with pytest.raises(torch.fx.proxy.TraceError):
        symbolic_capture(model, CaptureConfig())  # no example inputs: as before
    gm = symbolic_capture(model, CaptureConfig(), (x,))
    guards = gm.meta["distopt_guards"]
    assert len(guards) == 2
    assert "`if x.shape[1] != self.channels:` is False" in guards[0]
    assert "`if y.dim() == 4:  # a branch taken as True` is True" in guards[1]
    assert "test_example_values.py:" in guards[0]
    torch.testing.assert_close(gm(x), model(x), rtol=0, atol=0)
    # Another batch size and image size take the same branches: no specialisation on them.
    other = torch.randn(5, 3, 4, 6)
    torch.testing.assert_close(gm(other), model(other), rtol=0, atol=0)
    # An input that would take the other branch fails at the guard, naming the line.
    with pytest.raises(AssertionError, match=r"`if x.shape\[1\] != self.channels:`.* is False"):
        gm(torch.randn(2, 4, 8, 8))


def test_tracing_on_example_values_leaves_the_model_and_inputs_untouched() -> None:
    model = ChecksChannels().train()  # batch norm would update its running statistics
    x = torch.randn(2, 3, 8, 8)
    before = {key: value.clone() for key, value in model.state_dict().items()}
    x_before = x.clone()
    symbolic_capture(model, CaptureConfig(), (x,))
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key]), key
    assert torch.equal(x, x_before)


class DataBranch(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fc(x).sum() > 0:
            return x
        return -x


def test_a_branch_on_the_data_is_still_refused_and_dynamo_takes_the_model() -> None:
    model = DataBranch()
    x = torch.randn(3, 4)
    with pytest.raises(torch.fx.proxy.TraceError, match="depends on the data"):
        symbolic_capture(model, CaptureConfig(), (x,))
    optimized = distopt.optimize(model, (x,))
    report = report_of(optimized)
    assert report is not None and report.tier == "dynamo"
    assert "if self.fc(x).sum() > 0" in (report.reason or "")


@dataclasses.dataclass
class Output:
    logits: torch.Tensor
    hidden: torch.Tensor | None = None


def _returns_dict_if_asked(forward: Any) -> Any:
    """As transformers' ``can_return_tuple``: the forward seen through ``*args, **kwargs``."""

    @functools.wraps(forward)
    def wrapper(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        as_tuple = kwargs.pop("return_tuple", False)
        out = forward(self, *args, **kwargs)
        return (out.logits,) if as_tuple else out

    return wrapper


class Classifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 3)

    @_returns_dict_if_asked
    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None, **kwargs: Any) -> Output:
        if x.shape[-1] != self.fc.in_features:
            raise ValueError("bad width")
        return Output(logits=self.fc(x))


def test_a_decorated_forward_returning_a_dataclass_keeps_its_output_type() -> None:
    model = Classifier()
    x = torch.randn(2, 4)
    optimized = distopt.optimize(model, (x,))
    report = report_of(optimized)
    assert report is not None and report.tier == "symbolic_trace", report.reason
    assert len(report.guards) == 1
    out = optimized(x)
    assert type(out) is Output and out.hidden is None
    torch.testing.assert_close(out.logits, model(x).logits)


def test_explain_lists_the_guards(capsys: pytest.CaptureFixture[str]) -> None:
    optimized = distopt.optimize(ChecksChannels().eval(), (torch.randn(2, 3, 8, 8),))
    distopt.explain(optimized, show_code=False)
    out = capsys.readouterr().out
    assert "2 branches taken as the example inputs take them" in out
    assert "`if x.shape[1] != self.channels:` is False" in out


def test_transformers_resnet_is_traced_symbolically() -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.ResNetConfig(
        embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], num_labels=3
    )
    model = transformers.ResNetForImageClassification(config).eval()
    x = torch.randn(2, 3, 32, 32)
    # Not timed: a model this small runs faster as written (the final check would keep it).
    optimized = distopt.optimize(model, (x,), config={"measure": {"enabled": False}})
    report = report_of(optimized)
    assert report is not None and report.tier == "symbolic_trace", report.reason
    assert report.fallback is None and report.verification is not None
    assert report.verification.passed
    out = optimized(x)
    assert type(out).__name__ == "ImageClassifierOutputWithNoAttention"
    with torch.no_grad():
        torch.testing.assert_close(out.logits, model(x).logits, rtol=1e-4, atol=1e-4)
