"""The modules fusion passes call: one convolution or linear with its epilogue, on derived weights.

``fold_conv_bn`` and ``mkldnn_fusion`` replace a chain of graph nodes (``conv → batch_norm →
add → relu``, ``linear → scale → gelu``) by one call of a :class:`FusedConv2d` or
:class:`FusedLinear`. The graph still passes the *original* parameters to that call (``get_attr``
nodes in a traced graph, placeholders in a Dynamo graph), so the model's ``state_dict`` is
untouched. What the kernel needs — BatchNorm folded into the weights, a layer scale folded into a
linear, weights reordered into oneDNN's blocked layout — is derived from those parameters once
and kept in a :class:`Derived` cache, recomputed when a source tensor is replaced, moved or
written in place (``load_state_dict``, an optimizer step, ``.to()``).

Every module can also compute its chain exactly as the original graph did (:meth:`reference`):
it does so whenever the fast path does not apply — gradients are needed (the fused oneDNN ops
have no backward), Dynamo is tracing the module, or the inputs are not what the kernel takes
(``other`` of another shape, a GPU tensor for a CPU kernel).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, Literal

import torch
from torch import nn
from torch.nn import functional as F

from distopt.errors import ConfigError
from distopt.estimate.ab import one_time_work

Kernel = Literal["aten", "mkldnn"]
"""``aten``: ``F.conv2d``/``F.linear`` on folded weights (any device); ``mkldnn``: oneDNN's
pointwise-fused ops on prepacked weights (CPU), the ops Inductor's CPU backend emits."""

UNARY: dict[str, Callable[..., torch.Tensor]] = {
    "relu": F.relu,
    "gelu": F.gelu,
    "swish": F.silu,
    "sigmoid": torch.sigmoid,
    "tanh": torch.tanh,
    "hardswish": F.hardswish,
}
"""Activations an epilogue may end with, by oneDNN's post-op name, and the op they stand for."""


@dataclasses.dataclass(frozen=True)
class Epilogue:
    """What follows the convolution or linear in the original graph, in this order."""

    batch_norm_eps: float | None = None
    """Eval-mode BatchNorm folded into the weights (convolutions only)."""
    scale: bool = False
    """A per-output-channel multiply folded into the weights (linears only: a layer scale)."""
    add: bool = False
    """Plus ``other``, a tensor of the output's shape (a residual)."""
    unary: str | None = None
    """A :data:`UNARY` activation last."""
    gelu_approximate: str = "none"

    def __post_init__(self) -> None:
        if self.unary is not None and self.unary not in UNARY:
            raise ConfigError(
                f"epilogue: unknown activation {self.unary!r} (known: {', '.join(UNARY)})"
            )

    def describe(self) -> str:
        parts = ["batch_norm"] if self.batch_norm_eps is not None else []
        parts += ["scale"] * self.scale + ["add"] * self.add + ([self.unary] if self.unary else [])
        return "+".join(parts) or "none"

    def activate(self, y: torch.Tensor) -> torch.Tensor:
        if self.unary is None:
            return y
        if self.unary == "gelu":
            return F.gelu(y, approximate=self.gelu_approximate)
        return UNARY[self.unary](y)


class Derived:
    """A value computed from tensors, recomputed when any of them changes.

    A tensor counts as changed when it is another object, its storage moved, or its version
    counter moved (every in-place write through autograd, ``copy_`` or an optimizer bumps it).
    ``by_value`` tensors are also compared with a copy of their values: BatchNorm's kernel writes
    its running statistics without bumping their counters (a training forward of the original
    model, whose buffers the optimized one shares). Inference-mode tensors have no version
    counter: the value is then recomputed on every call. The first computation is marked
    :func:`~distopt.estimate.ab.one_time_work`, which an A/B timing leaves out.
    """

    def __init__(self) -> None:
        self._key: tuple[Any, ...] | None = None
        self._value: Any = None
        self._values: list[torch.Tensor] = []

    def get(
        self,
        sources: Sequence[torch.Tensor | None],
        extra: tuple[Any, ...],
        compute: Callable[[], Any],
        by_value: Sequence[torch.Tensor | None] = (),
    ) -> Any:
        try:
            key = extra + tuple(
                None if t is None else (id(t), t.data_ptr(), t._version) for t in sources
            )
        except RuntimeError:  # an inference tensor: no version counter to trust
            return compute()
        watched = [t for t in by_value if t is not None]
        same = key == self._key and all(
            torch.equal(t, v) for t, v in zip(watched, self._values, strict=True)
        )
        if not same:
            # The first derivation is a one-time cost an A/B timing leaves out; a recomputation
            # (a source written since) may recur on every call, so it counts.
            first = self._key is None
            with one_time_work() if first else contextlib.nullcontext():
                self._value = compute()
            self._key = key
            self._values = [t.detach().clone() for t in watched]
        return self._value

    def clear(self) -> None:
        self._key = self._value = None
        self._values = []

    def __getstate__(self) -> dict[str, Any]:
        # Derived values are recomputed from the sources; never copied or pickled (a packed oneDNN
        # weight has no storage to copy, and a copy's sources are other tensors anyway).
        return {"_key": None, "_value": None, "_values": []}


def _fast_path_allowed(*tensors: torch.Tensor | None) -> bool:
    """Fused kernels have no backward and are opaque to Dynamo: only for plain inference calls."""
    # Dynamo tracing the module sees the plain ops (is_compiling() would also be true while a
    # backend runs, e.g. when a pass times the graph it is compiling).
    if torch.compiler.is_dynamo_compiling():
        return False
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors):
        return False
    return True


def _mkldnn_takes(*tensors: torch.Tensor | None) -> bool:
    return all(t is None or (t.device.type == "cpu" and t.dtype == torch.float32) for t in tensors)


class FusedConv2d(nn.Module):
    """``conv2d`` and its :class:`Epilogue` as one call (see the module docstring).

    ``forward(x, weight, bias, bn_mean, bn_var, bn_weight, bn_bias, other)`` takes the original
    parameters; unused ones are ``None``.
    """

    def __init__(
        self,
        *,
        stride: tuple[int, int],
        padding: tuple[int, int],
        dilation: tuple[int, int],
        groups: int,
        epilogue: Epilogue,
        kernel: Kernel = "aten",
        origin: str = "",
    ) -> None:
        super().__init__()
        self.stride, self.padding, self.dilation, self.groups = stride, padding, dilation, groups
        self.epilogue = epilogue
        self.kernel: Kernel = kernel
        self.origin = origin
        """The user's modules or nodes this call replaces, for messages (``layer1.conv1+layer1.bn1``)."""
        self.folded = Derived()
        self.packed = Derived()
        if epilogue.batch_norm_eps is not None:
            self.train(False)  # built for an eval graph; forward refuses training mode

    def extra_repr(self) -> str:
        return (
            f"{self.origin or 'conv2d'}, epilogue={self.epilogue.describe()}, kernel={self.kernel}"
        )

    def with_kernel(self, kernel: Kernel, epilogue: Epilogue) -> FusedConv2d:
        """A new module doing the same convolution with another kernel and a longer epilogue."""
        return FusedConv2d(
            stride=self.stride,
            padding=self.padding,
            dilation=self.dilation,
            groups=self.groups,
            epilogue=epilogue,
            kernel=kernel,
            origin=self.origin,
        )

    def forward(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        bn_mean: torch.Tensor | None = None,
        bn_var: torch.Tensor | None = None,
        bn_weight: torch.Tensor | None = None,
        bn_bias: torch.Tensor | None = None,
        other: Any = None,
    ) -> torch.Tensor:
        ep = self.epilogue
        if ep.batch_norm_eps is not None and self.training:
            # Folded weights bake in eval-mode statistics: training through them is silently wrong.
            raise ConfigError(
                f"{self.origin} were folded for eval by distopt; call .eval(), or optimize the "
                "training model (BatchNorm is folded only in eval mode)"
            )
        bn = (bn_mean, bn_var, bn_weight, bn_bias)
        if not (
            _fast_path_allowed(
                x, weight, bias, *bn, other if isinstance(other, torch.Tensor) else None
            )
            and x.dim() == 4
            and (not ep.add or self._other_fits(x, weight, other))
        ):
            return self.reference(x, weight, bias, *bn, other)
        if self.kernel == "mkldnn" and _mkldnn_takes(x, weight, bias, *bn, other):
            return self._mkldnn(x, weight, bias, bn, other)
        w, b = self._folded(x, weight, bias, bn)
        y = F.conv2d(x, w, b, self.stride, self.padding, self.dilation, self.groups)
        if ep.add:
            y = y + other
        return ep.activate(y)

    def reference(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        bn_mean: torch.Tensor | None,
        bn_var: torch.Tensor | None,
        bn_weight: torch.Tensor | None,
        bn_bias: torch.Tensor | None,
        other: Any,
    ) -> torch.Tensor:
        """The original chain, op for op."""
        ep = self.epilogue
        y = F.conv2d(x, weight, bias, self.stride, self.padding, self.dilation, self.groups)
        if ep.batch_norm_eps is not None:
            y = F.batch_norm(y, bn_mean, bn_var, bn_weight, bn_bias, False, 0.0, ep.batch_norm_eps)
        if ep.add:
            y = y + other
        return ep.activate(y)

    def _other_fits(self, x: torch.Tensor, weight: torch.Tensor, other: Any) -> bool:
        if (
            not isinstance(other, torch.Tensor)
            or other.dtype != x.dtype
            or other.device != x.device
        ):
            return False
        spatial = [
            (size + 2 * pad - dil * (k - 1) - 1) // st + 1
            for size, pad, dil, k, st in zip(
                x.shape[2:], self.padding, self.dilation, weight.shape[2:], self.stride, strict=True
            )
        ]
        return list(other.shape) == [x.shape[0], weight.shape[0], *spatial]

    def _fold(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        bn: tuple[torch.Tensor | None, ...],
        fmt: torch.memory_format,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Weights with BatchNorm folded in (if any), detached, in memory format ``fmt``."""
        with torch.no_grad():
            w, b = weight, bias
            if self.epilogue.batch_norm_eps is not None:
                mean, var, gamma, beta = bn
                assert mean is not None and var is not None  # fold_conv_bn passes running stats
                w, b = torch.nn.utils.fusion.fuse_conv_bn_weights(
                    weight, bias, mean, var, self.epilogue.batch_norm_eps, gamma, beta
                )
            return w.detach().contiguous(memory_format=fmt), None if b is None else b.detach()

    def _folded(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        bn: tuple[torch.Tensor | None, ...],
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """:meth:`_fold` in the input's memory format (no per-call reorder), cached."""
        nhwc = not x.is_contiguous() and x.is_contiguous(memory_format=torch.channels_last)
        fmt = torch.channels_last if nhwc else torch.contiguous_format
        result: tuple[torch.Tensor, torch.Tensor | None] = self.folded.get(
            (weight, bias, *bn), (fmt,), lambda: self._fold(weight, bias, bn, fmt), by_value=bn[:2]
        )
        return result

    def _mkldnn(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        bn: tuple[torch.Tensor | None, ...],
        other: torch.Tensor | None,
    ) -> torch.Tensor:
        ep = self.epilogue
        stride, padding, dilation = list(self.stride), list(self.padding), list(self.dilation)

        def compute() -> tuple[torch.Tensor, torch.Tensor | None]:
            w, b = self._fold(weight, bias, bn, torch.channels_last)
            with torch.no_grad():
                # oneDNN's blocked weight layout, chosen for this input shape: reordered once.
                packed = torch.ops.mkldnn._reorder_convolution_weight(
                    w,
                    padding,
                    stride,
                    dilation,
                    self.groups,
                    list(x.shape),
                )
            return packed, b

        packed, b = self.packed.get((weight, bias, *bn), tuple(x.shape), compute, by_value=bn[:2])
        algorithm = ep.gelu_approximate if ep.unary == "gelu" else ""
        if ep.add:
            return torch.ops.mkldnn._convolution_pointwise.binary(
                x,
                other,
                packed,
                b,
                padding,
                stride,
                dilation,
                self.groups,
                "add",
                1.0,
                ep.unary,
                [],
                algorithm,
            )
        return torch.ops.mkldnn._convolution_pointwise(
            x, packed, b, padding, stride, dilation, self.groups, ep.unary or "none", [], algorithm
        )


class FusedLinear(nn.Module):
    """``linear`` and its :class:`Epilogue` (scale, then add or an activation) as one call.

    ``forward(x, weight, bias, scale, other)`` takes the original parameters; unused ones are
    ``None``. The only kernel is oneDNN's (``aten`` linears have nothing to fuse).
    """

    def __init__(self, *, epilogue: Epilogue, origin: str = "") -> None:
        super().__init__()
        if epilogue.batch_norm_eps is not None or (epilogue.add and epilogue.unary is not None):
            raise ConfigError(
                f"FusedLinear: epilogue {epilogue.describe()!r} has no oneDNN linear op"
            )
        self.epilogue = epilogue
        self.origin = origin
        self.packed = Derived()

    def extra_repr(self) -> str:
        return f"{self.origin or 'linear'}, epilogue={self.epilogue.describe()}, kernel=mkldnn"

    def forward(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        scale: torch.Tensor | None = None,
        other: Any = None,
    ) -> torch.Tensor:
        ep = self.epilogue
        if not (
            _fast_path_allowed(
                x, weight, bias, scale, other if isinstance(other, torch.Tensor) else None
            )
            and _mkldnn_takes(x, weight, bias, scale)
            and x.dim() >= 2
            and (scale is None or scale.shape == weight.shape[:1])
            and (not ep.add or self._other_fits(x, weight, other))
        ):
            return self.reference(x, weight, bias, scale, other)
        rows = x.numel() // x.shape[-1]

        def compute() -> tuple[torch.Tensor, torch.Tensor | None]:
            with torch.no_grad():
                w, b = weight, bias
                if scale is not None:
                    w, b = weight * scale[:, None], None if bias is None else bias * scale
                return torch.ops.mkldnn._reorder_linear_weight(w.detach().contiguous(), rows), b

        packed, b = self.packed.get((weight, bias, scale), (rows,), compute)
        if ep.add:
            return torch.ops.mkldnn._linear_pointwise.binary(x, other, packed, b, "add")
        algorithm = ep.gelu_approximate if ep.unary == "gelu" else ""
        return torch.ops.mkldnn._linear_pointwise(x, packed, b, ep.unary or "none", [], algorithm)

    def reference(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        scale: torch.Tensor | None,
        other: Any,
    ) -> torch.Tensor:
        """The original chain, op for op."""
        y = F.linear(x, weight, bias)
        if scale is not None:
            y = scale * y
        if self.epilogue.add:
            y = y + other
        return self.epilogue.activate(y)

    @staticmethod
    def _other_fits(x: torch.Tensor, weight: torch.Tensor, other: Any) -> bool:
        return (
            isinstance(other, torch.Tensor)
            and other.dtype == torch.float32
            and other.device.type == "cpu"
            and list(other.shape) == [*x.shape[:-1], weight.shape[0]]
        )
