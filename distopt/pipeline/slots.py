"""The main stage's issue op: take the future the pipeline prefetched for a slot, or issue now.

The pipeline hands a step's prefetched issues to its main stage with :func:`provided`; outside it
(evaluation, verification, a model used on its own) every slot issues as the model was written.
A prefetched issue is used only if it was given arguments equal to those the main stage computes
for the batch (the ids of the batch in hand), so a pipeline that fed the wrong batch fails loudly
instead of training on another batch's rows.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.fx

from distopt.errors import DistoptError


class PipelineError(DistoptError, RuntimeError):
    """The pipeline's prefetched reads do not belong to the batch the model is running."""


Issued = tuple[Any, tuple[Any, ...], dict[str, Any]]
"""``(future, args, kwargs)`` of one prefetched issue."""

_LOCAL = threading.local()


@contextlib.contextmanager
def provided(issued: Sequence[Issued] | None) -> Iterator[None]:
    """Run the main stage with ``issued[i]`` as the issue of slot ``i`` (on this thread);
    ``None`` changes nothing (a loop without a pipeline)."""
    if issued is None:
        yield
        return
    saved = getattr(_LOCAL, "issued", None)
    _LOCAL.issued = list(issued)
    try:
        yield
    finally:
        _LOCAL.issued = saved


def same_arguments(a: Any, b: Any) -> bool:
    """Equal call arguments: tensors by value (shape, dtype and elements), the rest by ``==``."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.shape == b.shape
            and a.dtype == b.dtype
            and torch.equal(a.cpu(), b.cpu())
        )
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same_arguments(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        return a.keys() == b.keys() and all(same_arguments(a[k], b[k]) for k in a)
    try:
        return bool(a == b)
    except Exception:
        return a is b


def slot_op(slot: int, issue: Callable[..., Any]) -> Callable[..., Any]:
    """The main stage's op for slot ``slot``: called with the arguments of ``issue``, it returns the
    future prefetched for the slot when the pipeline provided one, else ``issue(*args, **kwargs)``."""
    name = getattr(issue, "__name__", "issue")

    def prefetched(*args: Any, **kwargs: Any) -> Any:
        issued = getattr(_LOCAL, "issued", None)
        if issued is None:
            return issue(*args, **kwargs)
        if slot >= len(issued):
            raise PipelineError(
                f"prefetch slot {slot} ({name}): the pipeline provided {len(issued)} slot(s)"
            )
        future, given_args, given_kwargs = issued[slot]
        if not (
            same_arguments(args, tuple(given_args)) and same_arguments(kwargs, dict(given_kwargs))
        ):
            raise PipelineError(
                f"prefetch slot {slot} ({name}): prefetched with other arguments than the batch in "
                "hand (the pipeline and the model disagree on which batch runs)"
            )
        return future

    prefetched.__name__ = prefetched.__qualname__ = f"prefetched_{slot}_{name}"
    prefetched._distopt_prefetch_slot = slot  # type: ignore[attr-defined]
    # An issue is an effect: dead-code elimination must keep it even if its future went unused.
    torch.fx.node.has_side_effect(prefetched)
    return prefetched
