"""Tensors to and from Ray server actors as NumPy arrays (``distopt.ps.transport.ray_wire``)."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch
from torch.utils._pytree import tree_leaves

from distopt.ps.transport.ray_wire import from_wire, to_wire


@pytest.mark.parametrize(
    "dtype",
    [
        torch.float32,
        torch.float64,
        torch.float16,
        torch.int64,
        torch.int32,
        torch.uint8,
        torch.bool,
    ],
)
def test_a_round_trip_through_pickle_keeps_values_dtype_and_shape(dtype: torch.dtype) -> None:
    value = (torch.arange(24).reshape(4, 6) % 3).to(dtype)
    wire = to_wire(("t0", value, [value[1:], {"rows": value.t()}], 0.5))
    assert isinstance(wire[1], np.ndarray) and isinstance(wire[2][1]["rows"], np.ndarray)
    back = from_wire(pickle.loads(pickle.dumps(wire, protocol=5)))
    assert back[0] == "t0" and back[3] == 0.5
    for got, want in ((back[1], value), (back[2][0], value[1:]), (back[2][1]["rows"], value.t())):
        assert isinstance(got, torch.Tensor) and got.dtype == dtype
        assert torch.equal(got, want)


def test_what_numpy_cannot_hold_crosses_as_a_tensor() -> None:
    bf16 = torch.ones(3, dtype=torch.bfloat16)
    wire = to_wire([bf16])
    assert wire[0] is bf16


def test_gradients_are_not_sent_along() -> None:
    weight = torch.ones(2, 3, requires_grad=True)
    wire = to_wire(weight * 2)
    assert isinstance(wire, np.ndarray) and float(wire.sum()) == 12.0


def test_a_read_only_array_becomes_a_writable_tensor_of_its_own() -> None:
    array = np.arange(6, dtype=np.float32)
    array.flags.writeable = False
    tensor = from_wire(array)
    tensor += 1  # would fail (or corrupt Ray's buffer) on a view of read-only memory
    assert float(array.sum()) == 15.0 and float(tensor.sum()) == 21.0


@pytest.mark.parametrize(
    "tree",
    [
        torch.ones(2),
        ("t0", torch.ones(2, 3), 0.5),
        [torch.zeros(1), torch.ones(2)],
        [("t0", torch.ones(2)), ("t1", torch.zeros(3))],
        {"emb": {"weight": torch.ones(2, 2), "shard": 0}},
        (),
        "ps0",
    ],
)
def test_every_shape_of_a_call_keeps_its_containers(tree: object) -> None:
    """A leaf and a flat tuple or list skip the pytree walk; the result is the same."""
    wire = to_wire(tree)
    assert type(wire) is (np.ndarray if isinstance(tree, torch.Tensor) else type(tree))
    assert not any(isinstance(leaf, torch.Tensor) for leaf in tree_leaves(wire))
    back = from_wire(wire)
    assert type(back) is type(tree)
    for got, want in zip(tree_leaves(back), tree_leaves(tree), strict=True):
        assert type(got) is type(want) and (
            got == want if not isinstance(want, torch.Tensor) else torch.equal(got, want)
        )
