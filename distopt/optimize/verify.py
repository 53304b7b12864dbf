"""Check that an optimized module computes what the original computes: outputs and gradients.

The original model runs once (:func:`run_reference`), its remote calls performed for real and
recorded; each candidate (the optimized graph, or a prefix of the pipeline while bisecting)
replays those results (:class:`distopt.remote.replay.Replay`), so no remote call runs twice and
randomness on a server cannot make a correct rewrite look wrong.

Both runs start from the same CPU and CUDA random states, and run convolutions in full float32
with deterministic cuDNN kernels (:func:`exact_math`): on CUDA, TF32 convolutions (PyTorch's
default) put a correct conv-BN fold of ResNet-50 1e-2 away from the original, a tolerance that
would pass real bugs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable, Iterator
from typing import Any, cast

import torch
import torch.fx
from torch import nn
from torch.utils._pytree import tree_flatten

from distopt.capture.dynamo_remote import checking
from distopt.config import VerifyConfig
from distopt.estimate.ab import default_clock
from distopt.passes.local.measured import answering_first_call
from distopt.remote.isolation import RngStates, isolated, kept_attributes, preserved_state
from distopt.remote.local import named_local_tensors, with_remote_calls
from distopt.remote.ops import remote_ops
from distopt.remote.record import Recording, backward_pass, recording
from distopt.remote.replay import Replay
from distopt.report import VerifyRecord


@dataclasses.dataclass
class RunResult:
    """Outputs and parameter gradients of one verification run."""

    outputs: list[torch.Tensor]
    flat: list[Any]
    grads: dict[str, torch.Tensor | None]


@contextlib.contextmanager
def exact_math() -> Iterator[None]:
    """Convolutions in full float32 (no TF32) with deterministic cuDNN kernels; the user's settings
    are put back after. The comparison then sees the rewrite, not the precision or the kernel
    choice. Matmul precision stays the user's: Dynamo's guards check it, so changing it here would
    make a Dynamo candidate compile again, unverified, on its first real call."""
    cudnn: Any = torch.backends.cudnn
    flags: list[tuple[Any, str, Any]] = [(cudnn, "allow_tf32", False)]
    try:  # the legacy flag, unless the user set TF32 per op (torch >= 2.9): reading it then raises
        _ = cudnn.allow_tf32
    except RuntimeError:
        flags = [(cudnn.conv, "fp32_precision", "ieee"), (cudnn.rnn, "fp32_precision", "ieee")]
    flags += [(cudnn, "deterministic", True), (cudnn, "benchmark", False)]
    saved = [(owner, name, getattr(owner, name)) for owner, name, _ in flags]
    try:
        for owner, name, value in flags:
            setattr(owner, name, value)
        yield
    finally:
        for owner, name, value in saved:
            setattr(owner, name, value)


@dataclasses.dataclass
class Reference:
    """The original model's run, done once: compared with every candidate (bisection included)."""

    result: RunResult
    recording: Recording
    """The remote calls the original made, with their results (replayed into candidates)."""
    rng: RngStates
    """The generators' states the original's run started from (each candidate's starts there)."""
    check_grads: bool
    seconds: float = 0.0
    """How long the original's run took (by ``distopt.estimate.ab.default_clock``)."""
    rebound: tuple[str, ...] = ()
    """Attributes of the original's modules its run bound or rebound (put back since:
    :func:`~distopt.remote.isolation.kept_attributes`)."""


def _run(
    module: nn.Module,
    forward: Callable[..., Any],
    inputs: tuple[Any, ...],
    rng: RngStates,
    check_grads: bool,
) -> RunResult:
    params = [(n, p) for n, p in named_local_tensors(module, "_parameters") if p.requires_grad]
    for _, p in params:
        p.grad = None
    with rng.forked(), exact_math(), torch.set_grad_enabled(check_grads):
        outputs = forward(*inputs)
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
            # The recording sees the remote calls of this thread only: a backward that autograd
            # runs on a device thread (a CUDA graph's) makes its calls unseen.
            with exact_math(), backward_pass():
                cast(torch.Tensor, loss).backward()
        grads = {n: (None if p.grad is None else p.grad.detach().clone()) for n, p in params}
    return RunResult([t.detach().clone() for t in tensors], flat_out, grads)


def run_reference(
    original: nn.Module,
    example_inputs: tuple[Any, ...],
    config: VerifyConfig,
    *,
    allow_writes: bool = True,
) -> Reference:
    """Run ``original`` once, its remote calls for real and recorded (the model ends unchanged).

    With ``allow_writes=False`` a remote write raises
    :class:`~distopt.remote.record.RemoteWriteRefused` before it is sent.
    """
    rng = RngStates.now()
    # An eval-mode model is optimized for inference (e.g. conv-bn folding): outputs must match,
    # gradients of parameters folded away are meaningless.
    check_grads = config.check_grads and original.training
    view = with_remote_calls(original)
    results: list[RunResult] = []
    with (
        preserved_state(view),
        kept_attributes(view) as rebound,
        isolated(),
        recording(view, allow_writes=allow_writes) as record,
    ):
        seconds = default_clock(
            "baseline",
            lambda: results.append(_run(view, view, example_inputs, rng, check_grads)),
        )
    return Reference(results[0], record, rng, check_grads, seconds, tuple(rebound))


def compare_modules(
    original: nn.Module,
    optimized: nn.Module,
    example_inputs: tuple[Any, ...],
    config: VerifyConfig,
    *,
    reference: Reference | None = None,
    reordered: Callable[[], bool] | None = None,
) -> VerifyRecord:
    """Run both modules on the same inputs and RNG state; compare outputs and parameter grads.

    The original runs once (``reference``, when given, is that run); a GraphModule candidate
    replays the original's remote-call results instead of calling the servers again.
    ``reordered`` says, once the candidate ran (Dynamo compiles during that call), whether a kept
    pass reordered floating-point math: the ``reordered_*`` tolerances then apply.
    """
    start = time.perf_counter()
    ref = reference or run_reference(original, example_inputs, config)
    forward: Callable[..., Any] = optimized
    replay: contextlib.AbstractContextManager[Any] = contextlib.nullcontext()
    if isinstance(optimized, torch.fx.GraphModule) and _answerable(optimized, example_inputs, ref):
        # Its last measured run was this very call: the same graph on the same inputs, without
        # grad, writing and drawing nothing (answering_first_call checks it, else runs it).
        forward = answering_first_call(optimized, example_inputs, optimized.forward)
    elif isinstance(optimized, torch.fx.GraphModule):
        replayer = Replay(optimized, ref.recording)
        forward, replay = replayer.run, replayer.outside()
    else:  # Dynamo: the compiled graphs' remote calls answer from the recording
        replay = checking(optimized, example_inputs, ref.recording)
    with preserved_state(optimized), isolated(), replay:
        got = _run(optimized, forward, example_inputs, ref.rng, ref.check_grads)
    loose = reordered is not None and reordered()
    record = _compare(ref.result, got, config, time.perf_counter() - start, reordered=loose)
    record.gradients = ref.check_grads
    return record


def _answerable(gm: torch.fx.GraphModule, inputs: tuple[Any, ...], ref: Reference) -> bool:
    """Whether a measured pass's last run of ``gm`` may stand for its verification run: an
    inference check of a graph that makes no remote call, on the CPU (on a GPU the timed run
    used the user's TF32 settings, which :func:`exact_math` turns off here)."""
    if ref.check_grads or ref.recording.calls or remote_ops(gm.graph):
        return False
    tensors = [t for t in (*inputs, *gm.parameters(), *gm.buffers()) if isinstance(t, torch.Tensor)]
    return all(t.device.type == "cpu" for t in tensors)


def _compare(
    ref: RunResult, opt: RunResult, config: VerifyConfig, seconds: float, *, reordered: bool = False
) -> VerifyRecord:
    rtol = config.reordered_rtol if reordered else config.rtol
    atol = config.reordered_atol if reordered else config.atol
    problems: list[str] = []
    if len(ref.flat) != len(opt.flat):
        problems.append(f"output structure differs ({len(ref.flat)} vs {len(opt.flat)} leaves)")
    max_diff = 0.0
    compared = 0
    pairs: list[tuple[str, torch.Tensor | None, torch.Tensor | None]] = [
        (f"output[{i}]", a, b)
        for i, (a, b) in enumerate(zip(ref.outputs, opt.outputs, strict=False))
    ]
    for name in ref.grads:
        pairs.append((f"grad of {name}", ref.grads[name], opt.grads.get(name)))
    missing = sorted(set(ref.grads) - set(opt.grads))
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
            problems.append(
                f"{label}: shape/dtype {tuple(a.shape)}/{a.dtype} vs {tuple(b.shape)}/{b.dtype}"
            )
            continue
        if a.is_floating_point() or a.is_complex():
            diff = (a - b).abs().max().item() if a.numel() else 0.0
            max_diff = max(max_diff, diff)
            scale = max(1.0, a.abs().max().item()) if reordered and a.numel() else 1.0
            if not torch.allclose(a, b, rtol=rtol, atol=atol * scale, equal_nan=True):
                problems.append(f"{label}: max abs diff {diff:.3g}")
        elif not torch.equal(a, b):
            problems.append(f"{label}: values differ")
    return VerifyRecord(
        passed=not problems,
        max_abs_diff=max_diff,
        rtol=rtol,
        atol=atol,
        compared=compared,
        reordered=reordered,
        message="; ".join(problems[:3])
        + (f" (+{len(problems) - 3} more)" if len(problems) > 3 else ""),
        seconds=seconds,
    )
