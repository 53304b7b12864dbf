"""Check that an optimized module computes what the original computes: outputs and gradients."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import Any, cast

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from distopt.config import VerifyConfig
from distopt.report import VerifyRecord

_ISOLATION_HOOKS: list[Callable[[], AbstractContextManager[Any]]] = []


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
def preserved_state(*modules: nn.Module) -> Iterator[None]:
    """Restore buffers (e.g. BatchNorm running stats) and ``.grad`` of ``modules`` on exit.

    Verification runs real forward/backward passes; the user's model must come out unchanged.
    """
    tensors: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    grads: dict[int, tuple[nn.Parameter, torch.Tensor | None]] = {}
    for module in modules:
        for buf in module.buffers():
            tensors.setdefault(id(buf), (buf, buf.detach().clone()))
        for param in module.parameters():
            grads.setdefault(id(param), (param, param.grad))
    try:
        yield
    finally:
        with torch.no_grad():
            for buf, saved in tensors.values():
                buf.copy_(saved)
        for param, grad in grads.values():
            param.grad = grad


def _run(module: nn.Module, inputs: tuple[Any, ...], seed_state: torch.Tensor, check_grads: bool):
    params = [p for p in module.parameters() if p.requires_grad]
    for p in params:
        p.grad = None
    with torch.random.fork_rng(devices=[]):
        torch.random.set_rng_state(seed_state)
        with torch.set_grad_enabled(check_grads):
            outputs = module(*inputs)
    flat_out, _ = tree_flatten(outputs)
    tensors = [t for t in flat_out if isinstance(t, torch.Tensor)]
    grads: dict[str, torch.Tensor | None] = {}
    if check_grads:
        differentiable = [t for t in tensors if t.requires_grad and t.is_floating_point()]
        if differentiable:
            # A fixed random projection catches gradient errors that a plain sum would cancel.
            gen = torch.Generator().manual_seed(0)
            loss = sum(
                (t * torch.randn(t.shape, generator=gen, dtype=t.dtype).to(t.device)).sum()
                for t in differentiable
            )
            # differentiable is not empty, so the sum is a tensor (never the start value 0).
            cast(torch.Tensor, loss).backward()
        names = {id(p): n for n, p in module.named_parameters()}
        grads = {names[id(p)]: (None if p.grad is None else p.grad.detach().clone()) for p in params}
    return [t.detach().clone() for t in tensors], flat_out, grads


def compare_modules(
    original: nn.Module,
    optimized: nn.Module,
    example_inputs: tuple[Any, ...],
    config: VerifyConfig,
) -> VerifyRecord:
    """Run both modules on the same inputs and RNG state; compare outputs and parameter grads."""
    start = time.perf_counter()
    seed_state = torch.random.get_rng_state()
    # An eval-mode model is optimized for inference (e.g. conv-bn folding): outputs must match,
    # gradients of parameters folded away are meaningless.
    check_grads = config.check_grads and original.training
    # Each run starts from the same buffers and RNG state, and the user's model ends unchanged.
    with preserved_state(original, optimized), isolated():
        ref_out, ref_flat, ref_grads = _run(original, example_inputs, seed_state, check_grads)
    with preserved_state(original, optimized), isolated():
        opt_out, opt_flat, opt_grads = _run(optimized, example_inputs, seed_state, check_grads)
    problems: list[str] = []
    if len(ref_flat) != len(opt_flat):
        problems.append(f"output structure differs ({len(ref_flat)} vs {len(opt_flat)} leaves)")
    max_diff = 0.0
    compared = 0
    pairs = [(f"output[{i}]", a, b) for i, (a, b) in enumerate(zip(ref_out, opt_out, strict=False))]
    for name in ref_grads:
        pairs.append((f"grad of {name}", ref_grads[name], opt_grads.get(name)))
    missing = sorted(set(ref_grads) - set(opt_grads))
    if missing:
        problems.append(f"parameters missing in the optimized model: {', '.join(missing[:3])}")
    for label, a, b in pairs:
        if a is None and b is None:
            continue
        if a is None or b is None:
            problems.append(f"{label}: present in one model only")
            continue
        compared += 1
        if a.shape != b.shape or a.dtype != b.dtype:
            problems.append(f"{label}: shape/dtype {tuple(a.shape)}/{a.dtype} vs {tuple(b.shape)}/{b.dtype}")
            continue
        if a.is_floating_point() or a.is_complex():
            diff = (a - b).abs().max().item() if a.numel() else 0.0
            max_diff = max(max_diff, diff)
            if not torch.allclose(a, b, rtol=config.rtol, atol=config.atol, equal_nan=True):
                problems.append(f"{label}: max abs diff {diff:.3g}")
        elif not torch.equal(a, b):
            problems.append(f"{label}: values differ")
    return VerifyRecord(
        passed=not problems,
        max_abs_diff=max_diff,
        rtol=config.rtol,
        atol=config.atol,
        compared=compared,
        message="; ".join(problems[:3]) + (f" (+{len(problems) - 3} more)" if len(problems) > 3 else ""),
        seconds=time.perf_counter() - start,
    )
