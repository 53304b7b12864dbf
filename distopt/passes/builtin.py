"""Imports every built-in pass module so each registers itself (see distopt.passes.core.base).

The order is registration order, which breaks ties between unconstrained passes.
"""
# ruff: noqa: I001, F401

from distopt.passes.local import remove_identity
from distopt.passes.remote import pair, split, hoist, batch, sink
from distopt.passes.fsdp import partition, fuse_units
from distopt.passes.local import fold_conv_bn, mkldnn_fusion, channels_last
