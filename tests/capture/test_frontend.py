import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.fx
from torch import nn

import distopt
from distopt.report import report_of


class Unused(nn.Module):
    """A parameter and a buffer the forward never touches must survive capture."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.spare = nn.Linear(4, 4)
        self.register_buffer("steps", torch.zeros(()))
        self.register_buffer("scratch", torch.ones(2), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)


class Branchy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:
            return self.fc(x)
        return -self.fc(x)


def _warns_each_step() -> None:
    warnings.warn("the user's own per-step warning", UserWarning, stacklevel=1)


def test_a_users_warning_shows_once_around_a_dynamo_captured_model() -> None:
    # Python shows a warning once per location by default; quieting Dynamo's own warnings in a
    # captured call must not reset that registry, or the user's warning repeats every step.
    model = Branchy()
    optimized = distopt.optimize(model, (torch.randn(3, 4),))
    assert report_of(optimized).tier == "dynamo"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        for _ in range(3):
            optimized(torch.randn(3, 4))
            _warns_each_step()
    assert [str(w.message) for w in caught] == ["the user's own per-step warning"]


def test_state_dict_keys_kept_even_for_unused_parameters() -> None:
    model = Unused()
    optimized = distopt.optimize(model, (torch.randn(2, 4),))
    assert isinstance(optimized, torch.fx.GraphModule)
    assert list(optimized.state_dict().keys()) == list(model.state_dict().keys())
    # Checkpoints move freely both ways.
    model.load_state_dict(optimized.state_dict())
    optimized.load_state_dict(model.state_dict())


def test_control_flow_goes_through_dynamo_and_names_the_source_line() -> None:
    model = Branchy()
    x = torch.randn(3, 4)
    optimized = distopt.optimize(model, (x,))
    report = report_of(optimized)
    assert report is not None and report.tier == "dynamo"
    assert "test_frontend.py" in (report.reason or "")
    assert "if x.sum() > 0" in (report.reason or "")
    assert list(optimized.state_dict().keys()) == list(model.state_dict().keys())
    torch.testing.assert_close(optimized(x), model(x))
    torch.testing.assert_close(optimized(-x.abs()), model(-x.abs()))


def test_dynamo_disabled_falls_back_with_warning_naming_the_line() -> None:
    model = Branchy()
    with pytest.warns(distopt.DistoptFallbackWarning, match=r"if x.sum\(\) > 0"):
        result = distopt.optimize(model, config={"capture": {"dynamo": False}})
    assert result is model
    assert report_of(model) is not None and report_of(model).tier == "eager_fallback"


def test_strict_raises_instead_of_falling_back() -> None:
    with pytest.raises(distopt.CaptureError, match="symbolic tracing failed"):
        distopt.optimize(Branchy(), config={"capture": {"dynamo": False}}, strict=True)


def test_user_model_is_not_modified() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        distopt.optimize(model, (torch.randn(8, 4),))
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key]), key
    assert all(p.grad is None for p in model.parameters())


def test_a_dynamo_failure_runs_the_module_as_written_with_one_warning() -> None:
    import torch._dynamo.exc

    from distopt.capture.dynamo_remote import CapturedCall

    model = Branchy()

    def broken(*args, **kwargs):
        raise torch._dynamo.exc.InternalTorchDynamoError("Method named_modules not supported")

    call = CapturedCall(broken, model, learns=False)
    x = torch.randn(2, 4)
    with pytest.warns(
        distopt.DistoptFallbackWarning, match="running Branchy as written from now on"
    ):
        torch.testing.assert_close(call(x), model(x))
    torch.testing.assert_close(call(x), model(x))  # stays eager, no second warning


def test_the_models_own_error_is_raised_as_is() -> None:
    import torch._dynamo.exc

    from distopt.capture.dynamo_remote import CapturedCall

    def broken(*args, **kwargs):
        raise torch._dynamo.exc.TorchRuntimeError("shape mismatch")

    call = CapturedCall(broken, Branchy(), learns=False)
    with pytest.raises(RuntimeError, match="mat1 and mat2 shapes cannot be multiplied"):
        call(torch.randn(2, 3))


_ITEM_MODEL = """
import warnings
import torch
from torch import nn
import distopt

class Scaled(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        s = x.abs().mean().item()  # a graph break for Dynamo; symbolic tracing fails on round()
        return self.lin(x) / (1.0 + round(s, 3))

warnings.simplefilter("error")  # a warning of distopt's would fail the run
model = Scaled()
x = torch.randn(4, 8)
optimized = distopt.optimize(model, (x,))
from distopt.report import report_of
assert report_of(optimized).tier == "dynamo", report_of(optimized)
torch.testing.assert_close(optimized(x), model(x))
print("ok")
"""


def test_dynamo_capture_of_a_graph_break_is_quiet(tmp_path: Path) -> None:
    """A model that calls ``.item()`` is captured by Dynamo in pieces; Dynamo's advice to users
    of torch.compile ("Graph break from `Tensor.item()`, consider setting ...") printed 15 lines on
    stderr of a run whose user never asked to compile (a new user's trial). Its own process: the
    advice is printed once per process."""
    from tests import shell

    script = tmp_path / "item_model.py"
    script.write_text(_ITEM_MODEL)
    proc = shell.run(sys.executable, script, cwd=tmp_path, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-2000:]
    assert proc.stderr == "", proc.stderr[-2000:]
