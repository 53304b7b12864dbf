"""Tensors between trainers and Ray server actors as NumPy arrays.

Ray pickles a ``torch.Tensor`` through ``torch.save`` (about 0.3 ms per tensor, however small) but
sends a NumPy array as an out-of-band buffer, so every tensor argument and result of a server call
crosses as an array and becomes a tensor again on the other side. What NumPy cannot hold
(``bfloat16``, an accelerator's tensor) crosses as a tensor; read-only arrays are copied.
Why and how: ``docs/ps_runtime.md`` ("Ray jobs").
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch.utils._pytree import tree_map

_NUMPY_DTYPES = frozenset(
    {
        torch.float64,
        torch.float32,
        torch.float16,
        torch.int64,
        torch.int32,
        torch.int16,
        torch.int8,
        torch.uint8,
        torch.bool,
    }
)


def _tensor_to_wire(leaf: Any) -> Any:
    if isinstance(leaf, torch.Tensor) and leaf.device.type == "cpu" and leaf.dtype in _NUMPY_DTYPES:
        return leaf.detach().resolve_conj().resolve_neg().numpy()
    return leaf


def _array_from_wire(leaf: Any) -> Any:
    if isinstance(leaf, np.ndarray):
        return torch.from_numpy(leaf if leaf.flags.writeable else leaf.copy())
    return leaf


def _map(fn: Callable[[Any], Any], tree: Any) -> Any:
    """``tree_map(fn, tree)``, without its flatten and unflatten for the shapes every call has: a
    leaf, or a plain tuple or list of leaves (a fetch's arguments, a batched fetch's rows)."""
    kind = type(tree)
    if kind is tuple or kind is list:
        if not any(isinstance(item, _CONTAINERS) for item in tree):
            return kind(fn(item) for item in tree)
    elif not isinstance(tree, _CONTAINERS):
        return fn(tree)
    return tree_map(fn, tree)


_CONTAINERS = (tuple, list, dict)


def to_wire(tree: Any) -> Any:
    """``tree`` with its CPU tensors of NumPy dtypes as arrays (detached; no copy)."""
    return _map(_tensor_to_wire, tree)


def from_wire(tree: Any) -> Any:
    """``tree`` with its arrays as tensors (copied when Ray gave them read-only)."""
    return _map(_array_from_wire, tree)
