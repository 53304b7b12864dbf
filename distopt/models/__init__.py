"""Model registry: example and reference models that jobs build by name.

A model module in this package registers a factory (a function or an ``nn.Module`` class)::

    def _inputs(model: nn.Module, batch_size: int, seed: int) -> tuple[torch.Tensor]:
        gen = torch.Generator().manual_seed(seed)
        return (torch.randn(batch_size, model.in_features, generator=gen),)

    @register_model("mlp", inputs=_inputs)
    def mlp(in_features: int = 32, hidden: int = 64) -> MLP: ...

and jobs call ``build("mlp", **model_kwargs)``. Every module of ``distopt.models`` is imported the
first time the registry is consulted, so adding a file is enough. A name of the form
``package.module:factory`` builds a user's factory without registering it (imported as
:mod:`distopt.user_code` says): a function (or class) taking ``model_kwargs`` and returning the
module, or ``(module, example_inputs)`` as ``distopt explain`` takes it. Every process of a job
calls it, the parameter servers too (to ask ``ps_tables()``), so it makes no remote call itself;
what a model that makes remote calls needs (``ps_tables()``, module-level functions sent to the
servers) is checked by ``distopt launch`` before anything is scheduled (:mod:`distopt.torchx.preflight`).

Synthetic inputs: :func:`make_inputs` asks the registration's ``inputs`` function, else the
example inputs the factory returned with the module, else the model's
``example_inputs(batch_size, seed)`` (or ``example_inputs(batch_size, *, generator)``) method; the
same seed gives the same batch. The loss is the registration's ``loss`` function, else the model's
``loss(outputs, inputs)`` method, else :func:`default_loss`.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import pkgutil
import weakref
from collections.abc import Callable
from typing import Any, TypeVar

import torch
from torch import nn

from distopt import user_code
from distopt.errors import ConfigError

InputsFn = Callable[[nn.Module, int, int], tuple[Any, ...]]
LossFn = Callable[[Any, tuple[Any, ...]], torch.Tensor]
F = TypeVar("F", bound=Callable[..., nn.Module])


@dataclasses.dataclass(kw_only=True, slots=True, frozen=True)
class ModelEntry:
    """A registered model."""

    name: str
    factory: Callable[..., nn.Module]
    inputs: InputsFn | None = None
    """``inputs(model, batch_size, seed)`` → positional inputs of one forward call."""
    loss: LossFn | None = None
    """``loss(outputs, inputs)`` → scalar training loss."""


_REGISTRY: dict[str, ModelEntry] = {}
_discovered = False
_FACTORY_INPUTS: weakref.WeakKeyDictionary[nn.Module, tuple[Any, ...]] = weakref.WeakKeyDictionary()
"""Example inputs a factory returned with its module (``(module, inputs)``)."""


def register_model(
    name: str, *, inputs: InputsFn | None = None, loss: LossFn | None = None
) -> Callable[[F], F]:
    """Decorator registering a model factory under ``name``."""

    def decorate(factory: F) -> F:
        existing = _REGISTRY.get(name)
        if existing is not None and existing.factory is not factory:
            where = f"{existing.factory.__module__}.{existing.factory.__qualname__}"
            raise ConfigError(f"model {name!r} is already registered by {where}")
        _REGISTRY[name] = ModelEntry(name=name, factory=factory, inputs=inputs, loss=loss)
        return factory

    return decorate


def _discover() -> None:
    """Import every module of this package so their ``@register_model`` calls run."""
    global _discovered
    if _discovered:
        return
    _discovered = True
    for info in pkgutil.iter_modules(__path__, prefix=f"{__name__}."):
        importlib.import_module(info.name)


def names() -> list[str]:
    """Registered model names, sorted."""
    _discover()
    return sorted(_REGISTRY)


def entry(name: str) -> ModelEntry:
    """The registration of ``name`` (or a ``module:attribute`` factory, unregistered)."""
    if ":" in name:
        factory = user_code.load(name, key="model")
        if not callable(factory):
            raise ConfigError(f"model: {name!r} is a {type(factory).__name__}, not a factory")
        return ModelEntry(name=name, factory=factory)
    _discover()
    if name not in _REGISTRY:
        known = ", ".join(sorted(_REGISTRY)) or "none"
        module, dot, attribute = name.rpartition(".")
        hint = f"; your own factory is named 'module:function', e.g. '{module}:{attribute}'"
        raise ConfigError(f"model: unknown model {name!r} (known: {known}{hint if dot else ''})")
    return _REGISTRY[name]


def build(name: str, **kwargs: Any) -> nn.Module:
    """Build registered model ``name`` with keyword arguments ``kwargs``."""
    factory = entry(name).factory
    try:
        inspect.signature(factory).bind(**kwargs)
    except TypeError as err:
        raise ConfigError(f"model_kwargs: {err} for model {name!r}") from None
    except ValueError:  # no signature available: let the call decide
        pass
    made = factory(**kwargs)
    if isinstance(made, tuple) and len(made) == 2 and isinstance(made[0], nn.Module):
        model, inputs = made
        _FACTORY_INPUTS[model] = tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)
        return model
    if not isinstance(made, nn.Module):
        raise ConfigError(
            f"model: factory of {name!r} returned {type(made).__name__}, not a Module or "
            "(Module, example_inputs)"
        )
    return made


def make_inputs(name: str, model: nn.Module, batch_size: int, *, seed: int = 0) -> tuple[Any, ...]:
    """Synthetic positional inputs for one forward call of ``model`` (built from ``name``)."""
    registered = entry(name).inputs
    if registered is not None:
        inputs = registered(model, batch_size, seed)
    elif model in _FACTORY_INPUTS:
        inputs = _FACTORY_INPUTS[model]
    elif callable(method := getattr(model, "example_inputs", None)):
        if "generator" in inspect.signature(method).parameters:
            inputs = method(batch_size, generator=torch.Generator().manual_seed(seed))
        else:
            inputs = method(batch_size, seed)
    else:
        raise ConfigError(
            f"model {name!r}: no inputs function registered, no example inputs returned by its "
            f"factory and {type(model).__name__} has no example_inputs(batch_size, seed) method"
        )
    return tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)


def default_loss(outputs: Any, inputs: tuple[Any, ...]) -> torch.Tensor:
    """Mean of squares over every floating-point tensor in ``outputs`` (drives outputs to zero).

    Synthetic jobs measure throughput, not accuracy: any loss that touches every output and has a
    gradient for every parameter exercises the same forward/backward work.
    """
    tensors = [t for t in _tensors(outputs) if t.is_floating_point()]
    if not tensors:
        raise ConfigError(
            f"model outputs hold no floating-point tensor to train on: {type(outputs).__name__}"
        )
    return sum(t.float().pow(2).mean() for t in tensors)  # type: ignore[return-value]


def loss_function(name: str, model: nn.Module) -> LossFn:
    """The training loss of model ``name`` (see the module docstring for the lookup order)."""
    registered = entry(name).loss
    if registered is not None:
        return registered
    method = getattr(model, "loss", None)
    return method if callable(method) else default_loss


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _tensors(v)]
    return []


__all__ = [
    "ModelEntry",
    "build",
    "default_loss",
    "entry",
    "loss_function",
    "make_inputs",
    "names",
    "register_model",
]
