"""Graph passes: the registry, the runner and the built-in passes.

The built-ins are listed here as a set: the order they run in comes from the constraints each
pass module declares with its ``PASS`` (ties by name), never from this listing.
"""

from distopt.passes.core.pass_base import (
    PassContext,
    PassFn,
    PassResult,
    PassSpec,
    add_pass,
    add_passes,
    register_pass,
    registered_passes,
    resolve_pipeline,
    unregister_pass,
)
from distopt.passes.core.runner import run_passes
from distopt.passes.fsdp import fuse_units, partition
from distopt.passes.local import channels_last, fold_conv_bn, mkldnn_fusion, remove_identity
from distopt.passes.remote import batch_fetch, hoist, pair, sink, split_remote
from distopt.remote.side_effects import eliminate_dead_code, is_impure, mark_side_effectful

BUILTIN_PASSES: frozenset[PassSpec] = frozenset(
    {
        batch_fetch.PASS,
        channels_last.PASS,
        fold_conv_bn.PASS,
        fuse_units.PASS,
        hoist.PASS,
        mkldnn_fusion.PASS,
        pair.PASS,
        partition.PASS,
        remove_identity.PASS,
        sink.PASS,
        split_remote.PASS,
    }
)
"""distopt's own passes (:func:`registered_passes` also holds those users register)."""

add_passes(BUILTIN_PASSES)

__all__ = [
    "BUILTIN_PASSES",
    "PassContext",
    "PassFn",
    "PassResult",
    "PassSpec",
    "add_pass",
    "add_passes",
    "eliminate_dead_code",
    "is_impure",
    "mark_side_effectful",
    "register_pass",
    "registered_passes",
    "resolve_pipeline",
    "run_passes",
    "unregister_pass",
]
