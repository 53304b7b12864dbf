"""Your own data: ``data.source: pkg.mod:make_dataset`` names a function returning the dataset.

The factory is called with ``data.kwargs`` as keyword arguments, plus ``split="train"`` or
``split="eval"`` and ``seed=<job seed>`` when its signature takes them. It returns either

- a ``torch.utils.data.Dataset`` or ``IterableDataset`` (batched with its ``collate_fn``
  attribute when it has one, else with ``default_collate``), or
- a tuple ``(dataset, collate_fn)``.

A collated batch that is a :class:`distopt.data.Batch` gives the model's inputs and the targets; a
tuple or list is taken as the model's positional inputs (no targets: the model's own loss applies).
A factory that takes ``split`` provides its own held-out data (return ``None`` for ``split="eval"``
to have none); otherwise a map-style dataset is split by ``data.holdout_fraction``.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from torch.utils.data import Dataset, IterableDataset

from distopt import user_code
from distopt.errors import ConfigError

Collate = Callable[[list[Any]], Any]


def load_factory(spec: str, *, key: str = "data.source") -> Callable[..., Any]:
    """The function ``pkg.mod:attr`` names; a name that does not import is a one-line error."""
    factory = user_code.load(spec, key=key)
    if not callable(factory):
        raise ConfigError(f"{key}: {spec!r} is a {type(factory).__name__}, not a function")
    return factory


def takes(factory: Callable[..., Any], name: str) -> bool:
    """Whether ``factory`` accepts keyword argument ``name``."""
    try:
        parameters = inspect.signature(factory).parameters
    except (TypeError, ValueError):
        return False
    return name in parameters or any(p.kind is p.VAR_KEYWORD for p in parameters.values())


def call_factory(
    spec: str, kwargs: dict[str, Any], *, split: str, seed: int, key: str = "data"
) -> tuple[Dataset | IterableDataset, Collate | None] | None:
    """``(dataset, collate_fn)`` of factory ``spec`` for ``split``; ``None`` when a factory that
    takes ``split`` returns ``None`` (no such split)."""
    factory = load_factory(spec, key=f"{key}.source")
    extra = {
        name: value
        for name, value in (("split", split), ("seed", seed))
        if name not in kwargs and takes(factory, name)
    }
    try:
        signature = inspect.signature(factory)
        signature.bind(**kwargs, **extra)
    except TypeError as err:
        given = ", ".join(
            [*(f"{k}={v!r}" for k, v in extra.items()), *(f"{k}=..." for k in kwargs)]
        )
        raise ConfigError(
            f"{key}.kwargs: {err} for {spec!r}: the job calls {spec}{signature} as "
            f"({given}): split and seed when it takes them, the rest from {key}.kwargs"
        ) from None
    except ValueError:  # no signature available: let the call decide
        pass
    result = factory(**kwargs, **extra)
    if result is None and "split" in extra:
        return None
    dataset, collate = result if isinstance(result, tuple) and len(result) == 2 else (result, None)
    if not isinstance(dataset, (Dataset, IterableDataset)):
        raise ConfigError(
            f"{key}.source: {spec!r} returned {type(result).__name__}, not a Dataset, "
            "IterableDataset or (dataset, collate_fn)"
        )
    if collate is not None and not callable(collate):
        raise ConfigError(
            f"{key}.source: {spec!r} returned a collate_fn that is not callable: {collate!r}"
        )
    return dataset, collate or getattr(dataset, "collate_fn", None)


__all__ = ["call_factory", "load_factory", "takes"]
