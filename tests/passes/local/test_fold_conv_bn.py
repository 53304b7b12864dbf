"""fold_conv_bn: eval graphs get one convolution per conv+BN pair; training graphs are left alone."""

from __future__ import annotations

import pytest
import torch
import torch.fx
from torch import nn

import distopt
from distopt.errors import ConfigError
from distopt.models import build, make_inputs
from distopt.passes import PassContext
from distopt.passes.local.fold_conv_bn import fold_conv_bn
from distopt.passes.local.fused import FusedConv2d
from distopt.report import report_of

# These tests check the rewrite, not the speed verdict on tiny models: no final timing check.
NO_GRADS = {"verify": {"check_grads": False}, "measure": {"enabled": False}}


def _resnet() -> nn.Module:
    model = build("resnet50", width=4, image_size=32, num_classes=10, blocks=(1, 1, 1, 1))
    with torch.no_grad():  # non-trivial BN statistics so folding has something to fold
        for m in model.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.running_mean.uniform_(-0.5, 0.5)
                m.running_var.uniform_(0.5, 2.0)
                m.weight.uniform_(0.5, 1.5)
                m.bias.uniform_(-0.2, 0.2)
    return model.eval()


def test_folds_every_conv_bn_pair_and_matches_eager() -> None:
    model = _resnet()
    x = make_inputs("resnet50", model, 2)
    gm = distopt.optimize(model, x, passes=["fold_conv_bn"], config=NO_GRADS, strict=True)
    modules = dict(gm.named_modules())
    called = [modules[str(n.target)] for n in gm.graph.nodes if n.op == "call_module"]
    assert not any(isinstance(m, nn.BatchNorm2d) for m in called)
    convs = sum(isinstance(m, nn.Conv2d) for m in model.modules())
    folded = [m for m in called if isinstance(m, FusedConv2d)]
    assert len(folded) == convs and all(m.epilogue.batch_norm_eps is not None for m in folded)
    with torch.no_grad():
        torch.testing.assert_close(gm(*x), model(*x), rtol=1e-4, atol=1e-5)


def test_state_dict_keys_kept_and_loading_refolds() -> None:
    model = _resnet()
    x = make_inputs("resnet50", model, 2)
    gm = distopt.optimize(model, x, passes=["fold_conv_bn"], config=NO_GRADS, strict=True)
    assert list(gm.state_dict().keys()) == list(model.state_dict().keys())
    other = _resnet()
    for m in other.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.add_(0.3)
    gm.load_state_dict(other.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(gm(*x), other(*x), rtol=1e-4, atol=1e-5)


def test_in_place_updates_refold() -> None:
    """Folded weights follow the model's tensors: an in-place write is seen on the next call."""
    model = _resnet()
    x = make_inputs("resnet50", model, 2)
    gm = distopt.optimize(model, x, passes=["fold_conv_bn"], config=NO_GRADS, strict=True)
    with torch.no_grad():
        gm(*x)
        for m in model.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.running_var.mul_(2.0)
        torch.testing.assert_close(gm(*x), model(*x), rtol=1e-4, atol=1e-5)


def test_training_graph_is_left_alone_and_the_report_says_why() -> None:
    model = _resnet().train()
    gm = distopt.optimize(
        model, make_inputs("resnet50", model, 2), passes=["fold_conv_bn"], strict=True
    )
    report = report_of(gm)
    assert report is not None
    (record,) = report.graphs[0].passes
    assert not record.modified and "training mode" in record.detail
    result = fold_conv_bn(torch.fx.symbolic_trace(model), PassContext(training=True))
    assert not result.modified


def test_a_graph_without_conv_batchnorm_says_so_in_either_mode() -> None:
    """Not "training mode" when there is no pair to fold (a new user's MLP read that reason)."""
    mlp = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.ReLU(), nn.Linear(4, 1))
    for training in (True, False):
        result = fold_conv_bn(torch.fx.symbolic_trace(mlp), PassContext(training=training))
        assert (result.modified, result.detail) == (
            False,
            "no convolution followed by BatchNorm to fold",
        )
    result = fold_conv_bn(torch.fx.symbolic_trace(_resnet()), PassContext(training=True))
    assert result.detail == (
        "training mode: BatchNorm normalizes with batch statistics, "
        "17 conv+batchnorm pairs left unfolded"  # stem, 4 blocks of 3, 4 downsamples
    )


def test_conv_with_other_users_is_left_alone() -> None:
    class TwoUsers(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv, self.bn = nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = self.conv(x)
            return self.bn(y) + y  # folding would lose the unnormalized y

    gm = torch.fx.symbolic_trace(TwoUsers().eval())
    result = fold_conv_bn(gm, PassContext(training=False))
    assert not result.modified


def test_folded_model_refuses_to_train() -> None:
    """Switching a folded model back to train() must fail loudly, never train on frozen stats."""
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)).eval()
    folded = distopt.optimize(
        model, (torch.randn(1, 3, 8, 8),), passes=["fold_conv_bn"], config=NO_GRADS
    )
    folded.train()
    with pytest.raises(ConfigError, match="folded for eval"):
        folded(torch.randn(1, 3, 8, 8))


class ReusedConv(nn.Module):
    """One conv module called twice: once before BatchNorm, once on a path without it."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.bn = nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(self.conv(x)) + self.conv(x)


def test_conv_reused_on_a_path_without_batchnorm_stays_correct() -> None:
    """torch.fx's ``fuse`` folds into the shared conv's weights and corrupts the second call."""
    model = ReusedConv().eval()
    with torch.no_grad():
        model.bn.running_mean.uniform_(-1, 1)
        model.bn.running_var.uniform_(0.5, 2.0)
    x = torch.randn(2, 4, 8, 8)
    gm = distopt.optimize(model, x, passes=["fold_conv_bn"], config=NO_GRADS, strict=True)
    modules = dict(gm.named_modules())
    called = [modules[str(n.target)] for n in gm.graph.nodes if n.op == "call_module"]
    assert sum(isinstance(m, FusedConv2d) for m in called) == 1 and model.conv in called
    with torch.no_grad():
        torch.testing.assert_close(gm(x), model(x), rtol=1e-5, atol=1e-5)


def test_running_statistics_updated_by_a_training_forward_refold() -> None:
    """BatchNorm's kernel updates running stats without bumping version counters: the optimized
    model, sharing them with the original, must still see the update."""
    model = _resnet()
    x = make_inputs("resnet50", model, 2)
    gm = distopt.optimize(model, x, passes=["fold_conv_bn"], config=NO_GRADS, strict=True)
    with torch.no_grad():
        gm(*x)
        model.train()
        model(*x)  # updates every BatchNorm's running statistics in place
        model.eval()
        torch.testing.assert_close(gm(*x), model(*x), rtol=1e-4, atol=1e-5)
