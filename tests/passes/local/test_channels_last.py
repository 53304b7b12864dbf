"""channels_last: inputs converted at entry, outputs returned in the original layout."""

from __future__ import annotations

import torch
import torch.fx
from torch import nn

import distopt
from distopt.models import build, make_inputs
from distopt.passes import PassContext
from distopt.passes.local.channels_last import (
    channels_last,
    restore_memory_format,
    to_channels_last,
)

# NHWC kernels sum in another order: gradients agree to ~1e-5, not bit for bit. These tests check
# the rewrite itself, so it applies unmeasured (test_measured.py covers the speed verdict).
LOOSE = {
    "verify": {"rtol": 1e-4, "atol": 1e-4},
    "pass_options": {"channels_last": {"measure": False}},
}
FORCED = {"pass_options": {"channels_last": {"measure": False}}}


class FeatureMap(nn.Module):
    """Returns a 4-D feature map and a 2-D head output."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.bn = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.fc = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        feat = torch.relu(self.bn(self.conv(x)))
        return feat, self.fc(feat.mean((2, 3)))


def test_outputs_keep_contiguous_format_and_values() -> None:
    model = FeatureMap()
    x = torch.randn(2, 3, 8, 8)
    gm = distopt.optimize(model, x, passes=["channels_last"], config=LOOSE, strict=True)
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert to_channels_last in targets and restore_memory_format in targets
    feat, head = gm(x)
    ref_feat, ref_head = model(x)
    assert feat.is_contiguous() and ref_feat.is_contiguous()
    torch.testing.assert_close(feat, ref_feat, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(head, ref_head, rtol=1e-4, atol=1e-5)


def test_convolutions_run_channels_last_inside() -> None:
    model = FeatureMap()
    gm = distopt.optimize(
        model, torch.randn(2, 3, 8, 8), passes=["channels_last"], config=LOOSE, strict=True
    )
    seen = []
    model.conv.register_forward_hook(
        lambda m, args, out: seen.append(out.is_contiguous(memory_format=torch.channels_last))
    )
    gm(torch.randn(2, 3, 8, 8))
    assert seen == [True]


def test_channels_last_outputs_stay_channels_last() -> None:
    class PassThrough(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(3, 3, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            # Returns its output in the caller's layout (empty_like preserves it).
            return self.conv(x) + torch.zeros_like(x)

    x = torch.randn(2, 3, 4, 4).contiguous(memory_format=torch.channels_last)
    model = PassThrough()
    assert not model(x).is_contiguous()
    gm = distopt.optimize(model, x, passes=["channels_last"], config=LOOSE, strict=True)
    out = gm(x)
    assert out.is_contiguous(memory_format=torch.channels_last) and not out.is_contiguous()


def test_no_convolutions_no_change() -> None:
    gm = torch.fx.symbolic_trace(nn.Sequential(nn.Linear(4, 4), nn.ReLU()))
    result = channels_last(gm, PassContext())
    assert not result.modified and "no convolutions" in result.detail


def test_fold_then_channels_last_on_resnet_matches_eager() -> None:
    model = build("resnet50", width=4, image_size=32, num_classes=10, blocks=(1, 1, 1, 1)).eval()
    x = make_inputs("resnet50", model, 2)
    gm = distopt.optimize(
        model,
        x,
        passes=["channels_last", "fold_conv_bn"],
        config={**FORCED, "verify": {"check_grads": False}},
        strict=True,
    )
    with torch.no_grad():
        torch.testing.assert_close(gm(*x), model(*x), rtol=1e-4, atol=1e-5)


def _grads(module: nn.Module, x: torch.Tensor) -> dict[str, torch.Tensor]:
    module.zero_grad()
    (module(x) * torch.arange(10.0)).sum().backward()
    return {k: p.grad.clone() for k, p in module.named_parameters()}


def test_training_step_in_channels_last_matches_eager_channels_last() -> None:
    model = build("resnet50", width=4, image_size=32, num_classes=10, blocks=(1, 1, 1, 1))
    (x,) = make_inputs("resnet50", model, 4)
    gm = distopt.optimize(
        model, x, passes=["channels_last"], config=FORCED, verify=False, strict=True
    )
    ours = _grads(gm, x)
    # Eager PyTorch fed an NHWC input runs the same kernels: the results must agree closely.
    eager_nhwc = _grads(model, x.contiguous(memory_format=torch.channels_last))
    for key in eager_nhwc:
        torch.testing.assert_close(ours[key], eager_nhwc[key], rtol=1e-5, atol=1e-5, msg=key)
    # Against NCHW only up to round-off (training BatchNorm on a tiny batch amplifies it).
    eager_nchw = _grads(model, x)
    for key in eager_nchw:
        scale = eager_nchw[key].abs().max().item() + 1e-6
        assert (ours[key] - eager_nchw[key]).abs().max().item() <= 1e-2 * scale, key


def test_hooks_run_a_module_channels_last_without_a_graph() -> None:
    from distopt.passes.local.channels_last import run_channels_last

    model = FeatureMap().eval()
    x = torch.randn(2, 3, 8, 8)
    ref_feat, ref_head = model(x)
    seen: list[bool] = []
    model.conv.register_forward_pre_hook(
        lambda _, args: seen.append(args[0].is_contiguous(memory_format=torch.channels_last))
    )
    run_channels_last(model)
    feat, head = model(x)
    assert seen == [True] and feat.is_contiguous()
    torch.testing.assert_close(feat, ref_feat, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(head, ref_head, rtol=1e-5, atol=1e-5)


def test_output_formats_come_from_fake_tensors_and_leave_fused_modules_caches_real() -> None:
    from distopt.passes import resolve_pipeline, run_passes
    from distopt.passes.local.channels_last import output_formats

    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU()).eval()
    x = torch.randn(2, 3, 8, 8)
    gm = torch.fx.symbolic_trace(model)
    run_passes(gm, resolve_pipeline(["fold_conv_bn"]), example_inputs=(x,), training=False)
    with torch.no_grad():
        # The fused module derives and caches its folded weight on its first call: a fake call
        # filling that cache with fakes would break the real calls after it.
        assert output_formats(gm, (x,)) == ["contiguous_format"]
        assert output_formats(gm, (x.to(memory_format=torch.channels_last),)) == ["channels_last"]
        # The oneDNN rewrite takes the layouts from such a fake call, then fuses the module.
        record = run_passes(
            gm,
            resolve_pipeline(["mkldnn_fusion"]),
            example_inputs=(x,),
            training=False,
            pass_options={"mkldnn_fusion": {"measure": False}},
        )
        assert record.passes[0].modified, record.passes[0].detail
        # Once more on the fused graph, whose modules hold oneDNN-packed weights.
        assert output_formats(gm, (x,)) == ["contiguous_format"]
        torch.testing.assert_close(gm(x), model(x), rtol=1e-4, atol=1e-4)
