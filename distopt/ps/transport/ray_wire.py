"""Tensors between trainers and Ray server actors as NumPy arrays.

Ray pickles a ``torch.Tensor`` through torch's own ``__reduce__``, which writes each storage with
``torch.save`` into a buffer: about 0.3 ms per tensor however small, so a batched fetch of 16
tables spent more time pickling than in its one round trip. Ray sends a NumPy array as a pickle-5
out-of-band buffer (no copy, no per-array file format). So every tensor argument and result of a
server call crosses as an array, and becomes a tensor again on the other side::

    before:  handle.push.remote("t0", ids, grads, 0.05)               # two torch.save calls
    after:   handle.push.remote("t0", ids.numpy(), grads.numpy(), 0.05)   # two raw buffers

What NumPy cannot hold (``bfloat16``, a tensor on an accelerator) crosses as a tensor, as before.
Arrays Ray hands over read-only (those it maps from its object store) are copied, so a fetched row
never aliases memory nobody may write.
"""

from __future__ import annotations

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


def to_wire(tree: Any) -> Any:
    """``tree`` with its CPU tensors of NumPy dtypes as arrays (detached; no copy)."""

    def one(leaf: Any) -> Any:
        if (
            isinstance(leaf, torch.Tensor)
            and leaf.device.type == "cpu"
            and leaf.dtype in _NUMPY_DTYPES
        ):
            return leaf.detach().resolve_conj().resolve_neg().numpy()
        return leaf

    return tree_map(one, tree)


def from_wire(tree: Any) -> Any:
    """``tree`` with its arrays as tensors (copied when Ray gave them read-only)."""

    def one(leaf: Any) -> Any:
        if isinstance(leaf, np.ndarray):
            return torch.from_numpy(leaf if leaf.flags.writeable else leaf.copy())
        return leaf

    return tree_map(one, tree)
