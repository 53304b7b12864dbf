"""Run a model for measurement or verification without leaving a trace on it.

Verification and cost measurement run real forward and backward passes; the user's buffers,
gradients and client-side remote state (e.g. the parameter-server client's record of fetched
rows) must come out as they went in. :func:`preserved_state` restores what lives in the modules,
:func:`isolated` enters every hook registered by a layer that keeps state of its own, and
:func:`forked_rng` / :class:`RngStates` keep the random generators (the CPU's and, once CUDA is
in use, every GPU's) as the user left them.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import Any

import torch
from torch import nn

from distopt.remote.local import is_remote_module, named_local_modules, named_local_tensors

_ISOLATION_HOOKS: list[Callable[[], AbstractContextManager[Any]]] = []


def _gpus_in_use() -> range:
    # is_initialized: a process that never touched the GPU starts no CUDA context here.
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return range(torch.cuda.device_count())
    return range(0)


@contextlib.contextmanager
def forked_rng() -> Iterator[None]:
    """Random numbers drawn inside come from copies of the default generators: the CPU's and each
    GPU's in use are as the caller left them afterwards."""
    with torch.random.fork_rng(devices=_gpus_in_use()):
        yield


@dataclasses.dataclass(frozen=True)
class RngStates:
    """The default generators' states: the CPU's, and each GPU's once CUDA is in use."""

    cpu: torch.Tensor
    cuda: tuple[torch.Tensor, ...] = ()

    @staticmethod
    def now() -> RngStates:
        gpus = _gpus_in_use()
        return RngStates(
            torch.random.get_rng_state(), tuple(torch.cuda.get_rng_state_all()) if gpus else ()
        )

    def same_as(self, other: RngStates) -> bool:
        mine, theirs = (self.cpu, *self.cuda), (other.cpu, *other.cuda)
        return len(mine) == len(theirs) and all(map(torch.equal, mine, theirs))

    @contextlib.contextmanager
    def forked(self) -> Iterator[None]:
        """Draw from these states inside; the caller's generators are put back after."""
        with forked_rng():
            torch.random.set_rng_state(self.cpu)
            if self.cuda:
                torch.cuda.set_rng_state_all(self.cuda)
            yield


def register_isolation_hook(factory: Callable[[], AbstractContextManager[Any]]) -> None:
    """Wrap every verification run in ``factory()``.

    For state outside the modules that a verification run must not leave behind, e.g. the
    parameter-server client's record of fetched rows (they must not be pushed later).
    """
    if factory not in _ISOLATION_HOOKS:
        _ISOLATION_HOOKS.append(factory)


@contextlib.contextmanager
def isolated() -> Iterator[None]:
    with contextlib.ExitStack() as stack:
        for factory in _ISOLATION_HOOKS:
            stack.enter_context(factory())
        yield


@contextlib.contextmanager
def preserved_state(*modules: nn.Module) -> Iterator[list[torch.Tensor]]:
    """Restore buffers (e.g. BatchNorm running stats) and ``.grad`` of ``modules`` on exit.

    Verification runs real forward/backward passes; the user's model must come out unchanged.
    Only local state counts (a ``RemoteModule`` lives on its owner). Yields a list that holds,
    after exit, the buffers whose values had changed (a run that wrote none left no trace).
    """
    restored: list[torch.Tensor] = []
    tensors: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    grads: dict[int, tuple[torch.Tensor, torch.Tensor | None]] = {}
    for module in modules:
        for _, buf in named_local_tensors(module, "_buffers"):
            tensors.setdefault(id(buf), (buf, buf.detach().clone()))
        for _, param in named_local_tensors(module, "_parameters"):
            grads.setdefault(id(param), (param, param.grad))
    try:
        yield restored
    finally:
        with torch.no_grad():
            # Only buffers whose values changed (BatchNorm's kernel writes its running statistics
            # without bumping their version counters, so compare values): a needless copy would
            # bump the counter and make values derived from the buffer (folded weights) stale.
            for buf, saved in tensors.values():
                if not torch.equal(buf, saved):
                    buf.copy_(saved)
                    restored.append(buf)
        for param, grad in grads.values():
            param.grad = grad


_MODULE_INTERNALS = frozenset(vars(nn.Module()))
"""What ``nn.Module`` itself keeps in a module's ``__dict__`` (``training``, ``_parameters``,
hooks...): not the user's attributes."""


@contextlib.contextmanager
def kept_attributes(root: nn.Module) -> Iterator[list[str]]:
    """Put back, on exit, the plain attributes of ``root`` and its submodules that the block
    bound or rebound (a forward's ``self.calls += 1``, ``self.last = out``), and yield a list that
    then holds their dotted paths (``calls``, ``tower.0.last``). A traced graph does not repeat
    such assignments, so verification must know of them; the user's model comes out as it was."""
    changed: list[str] = []
    saved = [
        (path, module, {k: v for k, v in vars(module).items() if k not in _MODULE_INTERNALS})
        for path, module in named_local_modules(root)
        if not is_remote_module(module)
    ]
    try:
        yield changed
    finally:
        for path, module, before in saved:
            now = vars(module)
            for name in [k for k in now if k not in _MODULE_INTERNALS]:
                if name in before and now[name] is before[name]:
                    continue
                changed.append(f"{path}.{name}" if path else name)
                if name in before:
                    now[name] = before[name]
                else:
                    del now[name]
            for name in before.keys() - now.keys():  # deleted by the block
                changed.append(f"{path}.{name}" if path else name)
                now[name] = before[name]
