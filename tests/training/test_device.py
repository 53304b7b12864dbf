"""Devices and precision: resolution, batches moved but host inputs kept, bf16 autocast."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from distopt.data import Batch
from distopt.errors import ConfigError
from distopt.models.dlrm import DLRM, DLRMConfig
from distopt.training.device import (
    NO_GPU,
    autocast,
    host_inputs,
    mixed_precision,
    resolve_device,
    to_device,
)


def test_cpu_and_auto() -> None:
    assert resolve_device("cpu") == torch.device("cpu")
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert resolve_device("auto").type == expected


@pytest.mark.skipif(torch.cuda.is_available(), reason="this host has a GPU")
def test_cuda_without_a_gpu_is_a_one_line_error() -> None:
    with pytest.raises(ConfigError, match="^device: 'cuda' requested but") as info:
        resolve_device("cuda")
    assert str(info.value) == NO_GPU


def test_batches_move_except_host_inputs() -> None:
    batch = Batch((torch.ones(2, 3), torch.arange(4)), torch.zeros(2))
    moved = to_device(batch, torch.device("meta"), keep=host_inputs(DLRM(DLRMConfig())))
    assert moved.inputs[0].device.type == "meta" and moved.targets.device.type == "meta"
    assert moved.inputs[1].device.type == "cpu"  # DLRM's ids only address server rows
    assert to_device(batch, torch.device("cpu")) is batch


def test_bf16_autocast_on_cpu_and_fsdp_policy() -> None:
    layer = nn.Linear(4, 4)
    with autocast(torch.device("cpu"), "bf16"):
        assert layer(torch.ones(2, 4)).dtype == torch.bfloat16
    with autocast(torch.device("cpu"), "fp32"):
        assert layer(torch.ones(2, 4)).dtype == torch.float32
    policy = mixed_precision("bf16")
    assert policy.param_dtype == torch.bfloat16 and policy.reduce_dtype == torch.float32
    assert mixed_precision("fp32") is None


@pytest.mark.cuda
def test_cuda_batches_are_copied_from_pinned_memory() -> None:
    device = resolve_device("cuda")
    batch = Batch((torch.ones(2, 3).pin_memory(), torch.arange(4)), None)
    moved = to_device(batch, device, keep={1})
    assert moved.inputs[0].device == device and moved.inputs[1].device.type == "cpu"
    torch.testing.assert_close(moved.inputs[0].cpu(), torch.ones(2, 3))
    with autocast(device, "bf16"):
        assert nn.Linear(3, 3).to(device)(moved.inputs[0]).dtype == torch.bfloat16
