import pytest
import torch
import torch.fx
from torch import nn

import distopt
from distopt.config import VerifyConfig
from distopt.errors import DistoptFallbackWarning, VerificationError
from distopt.optimize.verify import compare_modules, exact_math
from distopt.remote.isolation import RngStates, forked_rng, kept_attributes, preserved_state
from distopt.report import report_of


def test_identical_modules_pass_and_count_outputs_and_grads() -> None:
    model = nn.Sequential(nn.Linear(4, 3), nn.Dropout(0.5))  # dropout: same RNG state in both runs
    record = compare_modules(model, model, (torch.randn(5, 4),), VerifyConfig())
    assert record.passed and record.compared == 3 and record.max_abs_diff == 0.0


def test_gradient_only_difference_is_detected() -> None:
    class StopGrad(nn.Module):
        def __init__(self, inner: nn.Module) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, x):
            y = self.inner(x)
            return y.detach() + (y - y.detach()) * 0.5  # same values, half the gradient

    inner = nn.Linear(4, 3)
    base = nn.Sequential()
    base.add_module("inner", inner)
    record = compare_modules(base, StopGrad(inner), (torch.randn(5, 4),), VerifyConfig())
    assert not record.passed
    assert "grad of inner.weight" in record.message


def test_tolerances_are_applied() -> None:
    a = nn.Linear(4, 3)
    b = nn.Linear(4, 3)
    b.load_state_dict(a.state_dict())
    with torch.no_grad():
        b.bias += 1e-4
    x = (torch.randn(2, 4),)
    assert not compare_modules(a, b, x, VerifyConfig(check_grads=False)).passed
    assert compare_modules(a, b, x, VerifyConfig(check_grads=False, atol=1e-3)).passed


def test_buffers_and_grads_restored() -> None:
    model = nn.BatchNorm1d(3)
    model.weight.grad = torch.ones(3)
    mean = model.running_mean.clone()
    with preserved_state(model):
        model(torch.randn(8, 3) + 5)
        model.weight.grad = None
    assert torch.equal(model.running_mean, mean)
    assert torch.equal(model.weight.grad, torch.ones(3))


def test_eval_mode_compares_outputs_only() -> None:
    model = nn.Linear(4, 3).eval()
    record = compare_modules(model, model, (torch.randn(5, 4),), VerifyConfig())
    assert record.passed and record.compared == 1


def _pushes_in_backward(config: dict | None = None):
    """The user's own table pushed to from backward (a write outside the graph), optimized."""
    import distopt
    from distopt.report import report_of
    from tests.estimate.remote_models import PushesInBackward, inputs
    from tests.passes.remote.inprocess_server import STORE

    STORE.reset()
    optimized = distopt.optimize(
        PushesInBackward(),
        inputs(),
        config=config,
        passes=["split_remote", "hoist_issue", "sink_wait"],
    )
    report = report_of(optimized)
    record = report.verification
    assert record is not None
    # What a pipeline running reads ahead of backward must know (distopt.pipeline.checks).
    assert len(report.backward_writes) == 1 and report.backward_writes[0].startswith("push at ")
    return record, STORE.log


def test_a_push_in_backward_is_never_sent_and_the_outputs_are_compared() -> None:
    record, log = _pushes_in_backward()
    assert record.passed and not record.gradients and record.compared == 1
    assert record.partial is not None and record.partial.startswith(
        "gradients not compared: backward sends push at "
    )
    assert [kind for kind, _, _ in log] == ["read", "read"]  # the two reference runs read; no push


def test_with_remote_writes_a_push_in_backward_is_applied_once_and_gradients_compared() -> None:
    record, log = _pushes_in_backward({"verify": {"remote_writes": True}})
    assert record.passed and record.gradients and record.compared == 3 and record.partial is None
    # The original's run sends the push once; the optimized run's backward is answered from it.
    assert log == [("read", "t1", 0), ("write", "t1", 1)]


class _Counting(nn.Module):
    """A user's trial: forward counts its calls and fails on the Nth; a traced graph would not
    count (the counter stopped at 2 and the failure never came)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0
        self.inner = nn.Linear(4, 4)
        self.norm = nn.BatchNorm1d(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.norm(self.inner(x))


def test_a_forward_that_assigns_attributes_is_not_returned_as_a_traced_graph() -> None:
    model = _Counting()
    x = torch.randn(8, 4)
    with pytest.warns(DistoptFallbackWarning) as caught:
        result = distopt.optimize(model, (x,))
    assert result is model and model.calls == 1  # only tracing ran the model's own forward
    message = str(caught[0].message)
    assert "_Counting.forward assigns calls (Python attributes)" in message
    assert "capture.symbolic=false" in message
    with pytest.raises(VerificationError, match="assigns calls"):
        distopt.optimize(model, (x,), strict=True)
    # Without the counter (the same leaf modules, whose own forward a traced graph calls): optimized.
    plain = distopt.optimize(nn.Sequential(model.inner, model.norm), (x,))
    assert isinstance(plain, torch.fx.GraphModule)


def test_kept_attributes_puts_back_what_a_block_assigned() -> None:
    model = _Counting()
    model.inner.tag = "a"
    with kept_attributes(model) as changed:
        model.calls = 5
        model.inner.tag = "b"
        model.fresh = 1
        del model.inner.tag
    assert sorted(changed) == ["calls", "fresh", "inner.tag"]
    assert model.calls == 0 and model.inner.tag == "a" and not hasattr(model, "fresh")


def test_exact_math_puts_the_users_settings_back() -> None:
    cudnn = torch.backends.cudnn
    saved = (cudnn.allow_tf32, cudnn.deterministic, cudnn.benchmark)
    cudnn.allow_tf32, cudnn.deterministic, cudnn.benchmark = True, False, True
    try:
        with exact_math():
            assert not cudnn.allow_tf32 and cudnn.deterministic and not cudnn.benchmark
        assert cudnn.allow_tf32 and not cudnn.deterministic and cudnn.benchmark
        with pytest.raises(RuntimeError, match="a failing run"), exact_math():
            raise RuntimeError("a failing run")
        assert cudnn.allow_tf32 and not cudnn.deterministic and cudnn.benchmark
    finally:
        cudnn.allow_tf32, cudnn.deterministic, cudnn.benchmark = saved


def test_exact_math_with_tf32_set_per_op() -> None:
    """A user of torch's per-op flags (torch >= 2.9), whose legacy flag can no longer be read."""
    cudnn = torch.backends.cudnn
    if not hasattr(getattr(cudnn, "conv", None), "fp32_precision"):
        pytest.skip("this torch has no per-op TF32 flags")
    saved = cudnn.allow_tf32
    cudnn.conv.fp32_precision = "tf32"
    try:
        with exact_math():
            assert cudnn.conv.fp32_precision != "tf32" and cudnn.rnn.fp32_precision != "tf32"
        assert cudnn.conv.fp32_precision == "tf32"
    finally:
        cudnn.allow_tf32 = saved  # the legacy setter makes both flags agree again


def test_exact_math_leaves_matmul_precision_to_the_user() -> None:
    """Dynamo's guards check it: a change would recompile a verified candidate, unverified."""
    saved = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("medium")
    try:
        with exact_math():
            assert torch.get_float32_matmul_precision() == "medium"
    finally:
        torch.set_float32_matmul_precision(saved)


class _ConvBN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(16, 32, 3, padding=1)
        self.bn = nn.BatchNorm2d(32)
        self.drop = nn.Dropout(0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(torch.relu(self.bn(self.conv(x))))


@pytest.mark.cuda
def test_conv_bn_folded_on_cuda_passes_verification() -> None:
    """CUDA convolutions run in TF32 by default: folded weights then differ by up to ~1e-2,
    which failed verification and returned every conv net unoptimized on a GPU."""
    model = _ConvBN().cuda().eval()
    with torch.no_grad():
        model.bn.running_mean.uniform_(-1, 1)
        model.bn.running_var.uniform_(0.5, 2)
    x = torch.randn(8, 16, 56, 56, device="cuda")
    optimized = distopt.optimize(model, x, strict=True)
    report = report_of(optimized)
    assert report is not None
    folds = [p.detail for g in report.graphs for p in g.passes if p.name == "fold_conv_bn"]
    assert folds and folds[0].startswith("folded 1 ")


@pytest.mark.cuda
def test_dropout_on_cuda_trains_the_same_under_verification() -> None:
    """Both verification runs start from the same CUDA random state (dropout on the GPU)."""
    model = _ConvBN().cuda().train()
    record = compare_modules(
        model, model, (torch.randn(4, 16, 16, 16, device="cuda"),), VerifyConfig()
    )
    assert record.passed and record.max_abs_diff == 0.0


def test_forked_rng_leaves_the_callers_generator_as_it_was() -> None:
    before = RngStates.now()
    with forked_rng():
        torch.randn(3)
    assert before.same_as(RngStates.now())
    torch.randn(3)
    assert not before.same_as(RngStates.now())


@pytest.mark.cuda
def test_forked_rng_covers_the_gpus_in_use() -> None:
    torch.randn(1, device="cuda")  # CUDA in use
    before = RngStates.now()
    assert before.cuda
    with forked_rng():
        torch.randn(3, device="cuda")
    assert before.same_as(RngStates.now())


class _NeedsAServer(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("RPC has not been initialized")


def test_a_model_failing_on_its_example_inputs_is_returned_with_the_reason() -> None:
    """A user's model whose remote calls have no RPC group (``distopt explain`` on a factory
    returning ``(model, inputs)``) had crashed optimize with a traceback from verification."""
    model = _NeedsAServer()
    with pytest.warns(DistoptFallbackWarning, match="running the original model failed"):
        result = distopt.optimize(model, (torch.randn(2, 3),))
    assert result is model
    fallback = report_of(result).fallback
    assert fallback is not None and fallback.startswith(
        "running the original model failed: RuntimeError: RPC has not been initialized (at "
    )
    with pytest.raises(RuntimeError, match="RPC has not been initialized"):
        distopt.optimize(model, (torch.randn(2, 3),), strict=True)


def test_example_inputs_the_model_cannot_run_are_blamed_not_the_pass() -> None:
    """A conv net given 8 channels where it takes 3: the first pass that runs the graph fails,
    and so does the model as written; the reason names the inputs' failure, not a pass bug."""
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU()).eval()
    with pytest.warns(DistoptFallbackWarning, match="running the original model failed"):
        result = distopt.optimize(model, (torch.randn(1, 8, 8, 8),))
    assert result is model
    fallback = report_of(result).fallback
    assert fallback is not None and "expected input[1, 8, 8, 8] to have 3 channels" in fallback
    assert "on the same example inputs" in fallback, fallback
