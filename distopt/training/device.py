"""Where a trainer computes and in what precision (the ``device`` and ``precision`` keys of a job).

- :func:`resolve_device`: ``cuda`` is GPU ``LOCAL_RANK`` (one GPU per trainer), checked before
  anything starts; ``auto`` falls back to the CPU.
- :func:`data_parallel_group`: the group DDP and FSDP communicate over. The trainers' default
  group is gloo (it carries barriers, checkpoint coordination and CPU metrics on every device);
  on CUDA, gradients and parameter shards go over an NCCL group of the same trainers, made from
  the default group's store, as torchtitan pairs ``cpu:gloo`` with ``cuda:nccl``.
- :func:`to_device`: a batch moved with ``non_blocking`` copies (the loader pins host batches when
  CUDA is present, so the copy overlaps the step). Inputs a model lists in ``host_inputs`` stay on
  the host: e.g. DLRM's ids only address parameter-server rows, which are fetched from host memory.
- :func:`autocast` and :func:`mixed_precision`: bf16 compute; FSDP2 gathers bf16 parameters and
  reduces fp32 gradients instead of autocasting (torchtitan's ``MixedPrecisionPolicy``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy

from distopt.data.batch import Batch
from distopt.errors import ConfigError

NO_GPU = (
    "device: 'cuda' requested but torch.cuda.is_available() is False on this host "
    "(no GPU, or a CPU-only build of torch); use device: cpu or auto"
)


def resolve_device(device: str, *, local_rank: int = 0) -> torch.device:
    """The trainer's device for config value ``device`` (``auto``, ``cpu`` or ``cuda``); selects
    GPU ``local_rank`` as the current CUDA device."""
    if device == "cpu":
        return torch.device("cpu")
    available = torch.cuda.is_available()
    if device == "cuda" and not available:
        raise ConfigError(NO_GPU)
    if not available:
        return torch.device("cpu")
    count = torch.cuda.device_count()
    if local_rank >= count:
        raise ConfigError(
            f"device: trainer has LOCAL_RANK {local_rank} but this host has {count} GPU(s); "
            "start at most one trainer per GPU"
        )
    torch.cuda.set_device(local_rank)
    return torch.device("cuda", local_rank)


def data_parallel_group(device: torch.device) -> Any:
    """The process group for DDP/FSDP: ``None`` (the default gloo group) on CPU, a new NCCL group
    of all trainers on CUDA. Every trainer must call this (``new_group`` is collective)."""
    if device.type != "cuda" or not dist.is_initialized():
        return None
    return dist.new_group(backend="nccl")


def device_mesh(device: torch.device, group: Any) -> Any:
    """A 1-D FSDP2 mesh of every trainer over ``group`` (``None``: FSDP2's default mesh)."""
    if group is None:
        return None
    return DeviceMesh.from_group(group, device.type)


def _move(value: Any, device: torch.device) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(device, non_blocking=True)
    if isinstance(value, dict):
        return {k: _move(v, device) for k, v in value.items()}
    if isinstance(value, (tuple, list)):
        return type(value)(_move(v, device) for v in value)
    return value


def host_inputs(model: nn.Module) -> frozenset[int]:
    """Positions of the inputs ``model`` wants on the host (its ``host_inputs`` attribute)."""
    return frozenset(getattr(model, "host_inputs", ()) or ())


def to_device(
    batch: Batch, device: torch.device, *, keep: Sequence[int] | frozenset[int] = ()
) -> Batch:
    """``batch`` on ``device`` (non-blocking copies), except inputs at positions ``keep``."""
    if device.type == "cpu":
        return batch
    inputs = tuple(v if i in keep else _move(v, device) for i, v in enumerate(batch.inputs))
    return Batch(inputs, _move(batch.targets, device))


def autocast(device: torch.device, precision: str) -> contextlib.AbstractContextManager[Any]:
    """bf16 autocast on ``device`` when ``precision`` is ``bf16``; a no-op otherwise."""
    if precision != "bf16":
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=torch.bfloat16)


def mixed_precision(precision: str) -> Any:
    """FSDP2's ``MixedPrecisionPolicy`` for ``precision`` (``None`` for fp32)."""
    if precision != "bf16":
        return None
    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def device_name(device: torch.device) -> str:
    """What ``device`` is, for reports: the GPU's model name (``NVIDIA H200``) or ``CPU``."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (step times measure work done, not work queued)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


__all__ = [
    "NO_GPU",
    "autocast",
    "data_parallel_group",
    "device_mesh",
    "device_name",
    "host_inputs",
    "mixed_precision",
    "resolve_device",
    "synchronize",
    "to_device",
]
