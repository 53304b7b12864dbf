"""mkldnn_fusion: conv/linear epilogues become oneDNN fused calls on prepacked weights (CPU, eval)."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
import torch.fx
from torch import nn

import distopt
from distopt.passes import PassContext
from distopt.passes.local.fused import FusedConv2d, FusedLinear
from distopt.passes.local.mkldnn_fusion import mkldnn_fusion
from distopt.report import report_of

# The rewrite itself, unmeasured, and no final timing check: the speed verdict is test_measured's.
FORCED = {
    "pass_options": {"mkldnn_fusion": {"measure": False}},
    "measure": {"enabled": False},
    "verify": {"check_grads": False},
}


class Block(nn.Module):
    """A ResNet block whose shortcut is computed after the main branch (HF's order)."""

    def __init__(self, shortcut: bool = True) -> None:
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(8, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8)
        self.conv2, self.bn2 = nn.Conv2d(8, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16)
        self.short = nn.Conv2d(8, 16, 1) if shortcut else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.bn2(self.conv2(torch.relu(self.bn1(self.conv1(x)))))
        r = self.short(x) if self.short is not None else torch.cat([x, x], 1)
        h += r
        return torch.relu(h)


def _fused(gm: torch.fx.GraphModule) -> list[nn.Module]:
    modules = dict(gm.named_modules())
    return [
        modules[str(n.target)]
        for n in gm.graph.nodes
        if n.op == "call_module"
        if isinstance(modules[str(n.target)], (FusedConv2d, FusedLinear))
    ]


def _eval(model: nn.Module) -> nn.Module:
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.running_mean.uniform_(-0.5, 0.5)
                m.running_var.uniform_(0.5, 2.0)
    return model.eval()


def test_resnet_block_becomes_three_fused_calls_and_matches_eager() -> None:
    model = _eval(Block())
    x = torch.randn(2, 8, 10, 10)
    gm = distopt.optimize(
        model, x, passes=["fold_conv_bn", "mkldnn_fusion"], config=FORCED, strict=True
    )
    fused = _fused(gm)
    assert [m.epilogue.describe() for m in fused] == [
        "batch_norm+relu",
        "none",
        "batch_norm+add+relu",
    ]
    assert all(m.kernel == "mkldnn" for m in fused)
    with torch.no_grad():
        out = gm(x)
        torch.testing.assert_close(out, model(x), rtol=1e-5, atol=1e-5)
    assert out.is_contiguous()  # restored to the layout the original returns


def test_a_call_that_needs_gradients_computes_the_original_chain() -> None:
    """The fused oneDNN ops have no backward: with grad enabled the exact original ops run."""
    model = _eval(Block())
    gm = distopt.optimize(
        model,
        torch.randn(2, 8, 10, 10),
        passes=["fold_conv_bn", "mkldnn_fusion"],
        config=FORCED,
        strict=True,
    )
    x = torch.randn(2, 8, 10, 10, requires_grad=True)
    (gm(x) * torch.arange(16.0)[:, None, None]).sum().backward()
    ours = x.grad.clone()
    x.grad = None
    (model(x) * torch.arange(16.0)[:, None, None]).sum().backward()
    torch.testing.assert_close(ours, x.grad, rtol=1e-5, atol=1e-5)


def test_an_add_written_into_the_other_operand_is_not_absorbed() -> None:
    class IntoResidual(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(4, 4, 3, padding=1)

        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            r = x * 2
            r.add_(self.conv(x))  # writes into r, which is returned: not the conv's epilogue
            return torch.relu(r), r

    gm = torch.fx.symbolic_trace(IntoResidual().eval())
    mkldnn_fusion(gm, PassContext(training=False, options={"measure": False}))
    (fused,) = _fused(gm)
    assert fused.epilogue.describe() == "none"


def test_convnext_block_in_a_dynamo_graph_fuses_linear_epilogues() -> None:
    """gelu after the first linear; layer scale and the residual add (through the permute back to
    NCHW) into the second: the ConvNeXt block as Dynamo captures it."""

    class ConvNextBlock(nn.Module):
        def __init__(self, dim: int = 8) -> None:
            super().__init__()
            self.dwconv = nn.Conv2d(dim, dim, 7, padding=3, groups=dim)
            self.norm = nn.LayerNorm(dim)
            self.fc1, self.fc2 = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)
            self.gamma = nn.Parameter(torch.rand(dim))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.dwconv(x).permute(0, 2, 3, 1)
            h = self.fc2(nn.functional.gelu(self.fc1(self.norm(h))))
            return x + (self.gamma * h).permute(0, 3, 1, 2)

    model = ConvNextBlock().eval()
    x = torch.randn(2, 8, 9, 9)
    config = {**FORCED, "capture": {"symbolic": False}}
    optimized = distopt.optimize(model, x, passes=["mkldnn_fusion"], config=config, strict=True)
    report = report_of(optimized)
    assert report is not None and report.verification is not None and report.verification.passed
    (record,) = report.graphs[0].passes
    assert "1× conv" in record.detail and "1× linear+gelu" in record.detail
    assert "1× linear+scale+add" in record.detail
    with torch.no_grad():
        torch.testing.assert_close(optimized(x), model(x), rtol=1e-5, atol=1e-5)


def test_prepacked_weights_follow_a_loaded_checkpoint() -> None:
    model = _eval(Block())
    x = torch.randn(2, 8, 10, 10)
    gm = distopt.optimize(
        model, x, passes=["fold_conv_bn", "mkldnn_fusion"], config=FORCED, strict=True
    )
    with torch.no_grad():
        gm(x)
        other = _eval(Block())
        gm.load_state_dict(other.state_dict())
        torch.testing.assert_close(gm(x), other(x), rtol=1e-5, atol=1e-5)


def test_training_graphs_are_left_alone() -> None:
    gm = torch.fx.symbolic_trace(Block())
    result = mkldnn_fusion(gm, PassContext(training=True, options={"measure": False}))
    assert not result.modified and "training mode" in result.detail


@pytest.mark.cuda
def test_cuda_graphs_are_left_alone() -> None:
    model = _eval(Block()).cuda()
    gm = torch.fx.symbolic_trace(model)
    ctx = PassContext(
        example_inputs=(torch.randn(2, 8, 10, 10, device="cuda"),),
        training=False,
        options={"measure": False},
    )
    result = mkldnn_fusion(gm, ctx)
    assert not result.modified and "CPU ops" in result.detail


def test_dynamo_tracing_a_fused_model_sees_the_original_ops() -> None:
    """A user compiling the optimized model gets plain ops Inductor can fuse itself."""
    gm = distopt.optimize(
        _eval(Block()),
        torch.randn(2, 8, 10, 10),
        passes=["fold_conv_bn", "mkldnn_fusion"],
        config=FORCED,
        strict=True,
    )
    targets: list[object] = []

    def recording(graph: torch.fx.GraphModule, example_inputs: list[object]) -> object:
        targets.extend(n.target for n in graph.graph.nodes if n.op == "call_function")
        return graph.forward

    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(gm, backend=recording)(torch.randn(2, 8, 10, 10))
    assert torch.conv2d in targets and not any("mkldnn" in str(t) for t in targets)


def test_the_fused_kernel_runs_inside_a_backend_timing_its_graph(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Passes time graphs while Dynamo compiles (is_compiling() is true there): the fast path runs."""
    gm = distopt.optimize(
        _eval(Block()),
        torch.randn(2, 8, 10, 10),
        passes=["fold_conv_bn", "mkldnn_fusion"],
        config=FORCED,
        strict=True,
    )
    calls: list[int] = []
    fast = FusedConv2d._mkldnn

    def counted(self: FusedConv2d, *args: object) -> torch.Tensor:
        calls.append(1)
        return fast(self, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(FusedConv2d, "_mkldnn", counted)

    def timing(graph: torch.fx.GraphModule, example_inputs: list[object]) -> object:
        with torch.no_grad():
            gm(torch.randn(2, 8, 10, 10))
        return graph.forward

    torch._dynamo.reset()
    torch.compile(lambda x: x + 1, backend=timing)(torch.zeros(1))
    assert len(calls) == 3


def test_a_copied_model_recomputes_its_packed_weights() -> None:
    """Packed oneDNN weights have no storage to copy: copies drop derived values and rebuild them."""
    import copy
    import pickle

    model = _eval(Block())
    x = torch.randn(2, 8, 10, 10)
    gm = distopt.optimize(
        model, x, passes=["fold_conv_bn", "mkldnn_fusion"], config=FORCED, strict=True
    )
    with torch.no_grad():
        gm(x)
        copied = copy.deepcopy(gm)
        torch.testing.assert_close(copied(x), model(x), rtol=1e-5, atol=1e-5)
    for module in _fused(gm):
        assert pickle.loads(pickle.dumps(module)).packed.get([], (), lambda: "rebuilt") == "rebuilt"


def test_an_epilogue_is_not_moved_past_an_in_place_write() -> None:
    class WritesBetween(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(4, 4, 3, padding=1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            r = x * 2
            h = self.conv(r)
            r.mul_(3)  # the conv must still see r before this write
            return torch.relu(h + r)

    model = WritesBetween().eval()
    gm = torch.fx.symbolic_trace(model)
    mkldnn_fusion(gm, PassContext(training=False, options={"measure": False}))
    gm.recompile()
    (fused,) = _fused(gm)
    assert fused.epilogue.describe() == "none"
    x = torch.randn(2, 4, 6, 6)
    with torch.no_grad():
        torch.testing.assert_close(gm(x), model(x), rtol=1e-5, atol=1e-5)
