"""The local part of a model that may hold ``RemoteModule`` submodules.

A ``torch.distributed.nn.RemoteModule`` lives on another worker and refuses most ``nn.Module``
methods (``named_modules``, ``parameters``, ``state_dict``, ``extra_repr``...), so a model holding
one cannot be walked with the usual APIs. These helpers walk ``_modules`` themselves and stop at a
remote module; :func:`with_remote_calls` gives a view of the model in which each remote module is
a local stand-in whose forward is one :func:`~distopt.remote.rpc_calls.remote_module_call`, which every
``nn.Module`` API, the tracer and Dynamo handle.
"""

from __future__ import annotations

import copy
import weakref
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.distributed.nn.api.remote_module import RemoteModule

from distopt.remote.rpc_calls import (
    RemoteModuleHandle,
    remote_module_call,
    remote_module_call_async,
)


def is_remote_module(module: Any) -> bool:
    return isinstance(module, RemoteModule)


def named_local_modules(root: nn.Module, prefix: str = "") -> Iterator[tuple[str, nn.Module]]:
    """``(path, module)`` for ``root`` and its submodules, each once, not entering remote modules."""
    seen: set[int] = set()
    stack = [(prefix, root)]
    while stack:
        path, module = stack.pop()
        if id(module) in seen:
            continue
        seen.add(id(module))
        yield path, module
        if is_remote_module(module):
            continue
        children = [
            (f"{path}.{n}" if path else n, m) for n, m in module._modules.items() if m is not None
        ]
        stack.extend(reversed(children))


def local_modules(root: nn.Module) -> Iterator[nn.Module]:
    for _, module in named_local_modules(root):
        yield module


def named_local_tensors(root: nn.Module, kind: str) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` of the local parameters (``kind="_parameters"``) or buffers
    (``"_buffers"``), each once, like ``named_parameters``/``named_buffers``."""
    seen: set[int] = set()
    for path, module in named_local_modules(root):
        if is_remote_module(module):
            continue
        for name, tensor in getattr(module, kind).items():
            if tensor is not None and id(tensor) not in seen:
                seen.add(id(tensor))
                yield (f"{path}.{name}" if path else name), tensor


def has_remote_modules(root: nn.Module) -> bool:
    return any(is_remote_module(m) for m in local_modules(root))


_HANDLES: weakref.WeakKeyDictionary[Any, dict[str, RemoteModuleHandle]] = (
    weakref.WeakKeyDictionary()
)


def handle_of(module: Any, path: str) -> RemoteModuleHandle:
    """The one handle of remote module ``module`` at ``path``, whichever view asks. A remote call
    site is known by the identity of its constants: the verification run records the calls of
    one view and Dynamo captures another, and with a handle each their sites would differ (every
    call a graph break, never rewritten)."""
    handles = _HANDLES.setdefault(module, {})
    handle = handles.get(path)
    if handle is None:
        handle = handles[path] = RemoteModuleHandle(module, path)
    return handle


class RemoteModuleCall(nn.Module):
    """Stands in for a ``RemoteModule`` in :func:`with_remote_calls` views: no local state, and a
    forward that is one blocking remote call (``remote_module(*args)``)."""

    def __init__(self, module: Any, path: str) -> None:
        super().__init__()
        # A plain object, not a submodule: nothing walks into the remote module.
        self.handle = handle_of(module, path)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return remote_module_call(self.handle, *args, **kwargs)

    def forward_async(self, *args: Any, **kwargs: Any) -> Any:
        return remote_module_call_async(self.handle, *args, **kwargs)

    def extra_repr(self) -> str:
        return repr(self.handle)


def with_remote_calls(model: nn.Module) -> nn.Module:
    """``model`` itself when it holds no remote module; else a view sharing every local
    parameter, buffer and submodule, with each remote module replaced by a
    :class:`RemoteModuleCall`. Only the modules on the way to a remote module are copied
    (shallowly), so ``model`` is never modified."""
    if not has_remote_modules(model):
        return model
    return _view(model, "")


def _view(module: nn.Module, path: str) -> nn.Module:
    if is_remote_module(module):
        return RemoteModuleCall(module, path)
    if not has_remote_modules(module):
        return module
    copied = copy.copy(module)
    copied._modules = {
        name: None if child is None else _view(child, f"{path}.{name}" if path else name)
        for name, child in module._modules.items()
    }
    return copied
