"""Registry of blocking remote calls (parameter-server RPCs) that distopt schedules."""

from distopt.remote.graph_args import concrete_args
from distopt.remote.registry import (
    RemoteCallSpec,
    effect_of,
    is_remote_call,
    leaf_callables,
    lookup,
    register_leaf_function,
    register_read,
    register_remote,
    register_write,
    registered_specs,
    remote,
    resource_of,
    unregister_remote,
)
from distopt.remote.wait import is_wait, source_line

# Declares torch.distributed.rpc's idioms (rpc_sync, RRef calls, rpc.remote, RemoteModule).
from distopt.remote import rpc_calls as rpc_calls  # noqa: E402  isort: skip

# Declares Ray's idioms (handle.method.remote, fn.remote, ray.get) once a model imports Ray.
from distopt.remote import ray_calls as ray_calls  # noqa: E402  isort: skip
from distopt.remote.ray_calls import register_batched  # noqa: E402  isort: skip

__all__ = [
    "RemoteCallSpec",
    "concrete_args",
    "is_wait",
    "source_line",
    "effect_of",
    "is_remote_call",
    "leaf_callables",
    "lookup",
    "register_batched",
    "register_leaf_function",
    "register_read",
    "register_remote",
    "register_write",
    "registered_specs",
    "remote",
    "resource_of",
    "unregister_remote",
]
