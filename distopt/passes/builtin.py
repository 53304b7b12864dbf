"""Imports every built-in pass module so each registers itself (see distopt.passes.base).

The order is registration order, which breaks ties between unconstrained passes.
"""
# ruff: noqa: I001

from distopt.passes import remove_identity  # noqa: F401
from distopt.passes import split_remote  # noqa: F401
from distopt.passes import hoist_issue  # noqa: F401
from distopt.passes import batch_fetch  # noqa: F401
from distopt.passes import sink_wait  # noqa: F401
from distopt.passes import partition  # noqa: F401
from distopt.passes import fuse_units  # noqa: F401
from distopt.passes import fold_conv_bn  # noqa: F401
from distopt.passes import channels_last  # noqa: F401
