"""Typed configs: dataclasses validated on construction, loaded from YAML or dicts.

Every error is a :class:`~distopt.errors.ConfigError` whose one-line message names the dotted key
and quotes the bad value, e.g. ``optimize.verify.rtol: expected a number >= 0, got -1``.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal, TypeVar

import yaml

from distopt.errors import ConfigError

T = TypeVar("T")


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """Check ``value`` against the annotation ``tp`` and convert YAML shapes (list → tuple)."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if tp is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for option in args:
            if option is type(None):
                continue
            try:
                return _coerce(value, option, key)
            except ConfigError as err:
                errors.append(str(err))
        raise ConfigError(errors[0] if len(errors) == 1 else f"{key}: invalid value {value!r}")
    if origin is Literal:
        if value not in args:
            choices = ", ".join(repr(a) for a in args)
            raise ConfigError(f"{key}: expected one of {choices}, got {value!r}")
        return value
    if origin in (tuple, list):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key}: expected a list, got {value!r}")
        item_tp = args[0] if args else Any
        items = [_coerce(v, item_tp, f"{key}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if origin in (dict, Mapping) or tp is dict:
        if not isinstance(value, Mapping):
            raise ConfigError(f"{key}: expected a mapping, got {value!r}")
        val_tp = args[1] if len(args) == 2 else Any
        return {str(k): _coerce(v, val_tp, f"{key}.{key_text(k)}") for k, v in value.items()}
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if not isinstance(value, Mapping):
            raise ConfigError(f"{key}: expected a mapping for {tp.__name__}, got {value!r}")
        return from_dict(tp, value, prefix=key)
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key}: expected true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key}: expected an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{key}: expected a number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{key}: expected a string, got {value!r}")
        return value
    if isinstance(tp, type) and not isinstance(value, tp):
        raise ConfigError(f"{key}: expected {_type_name(tp)}, got {value!r}")
    return value


def key_text(key: Any) -> str:
    """A user's key as it goes into a one-line message: as written when it is a printable string,
    else its ``repr`` (a key holding a newline must not break the message in two)."""
    return key if isinstance(key, str) and key.isprintable() else repr(key)


def from_dict(cls: type[T], data: Mapping[str, Any], *, prefix: str = "") -> T:
    """Build dataclass ``cls`` from ``data``, rejecting unknown keys and ill-typed values."""
    if not isinstance(data, Mapping):
        where = prefix or cls.__name__
        raise ConfigError(f"{where}: expected a mapping, got {data!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}  # type: ignore[arg-type]
    dotted = (prefix + ".") if prefix else ""
    unknown = [k for k in data if k not in fields]
    if unknown:
        known = ", ".join(sorted(fields))
        raise ConfigError(f"{dotted}{key_text(unknown[0])}: unknown key (known keys: {known})")
    missing = [
        name
        for name, f in fields.items()
        if name not in data
        and f.default is dataclasses.MISSING
        and f.default_factory is dataclasses.MISSING
    ]
    if missing:
        raise ConfigError(f"{dotted}{missing[0]}: missing (a required key of {cls.__name__})")
    kwargs = {name: _coerce(value, hints[name], f"{dotted}{name}") for name, value in data.items()}
    try:
        return cls(**kwargs)
    except TypeError as err:  # a __post_init__ check meeting a value it cannot compare
        raise ConfigError(f"{prefix or cls.__name__}: {err}") from None
    except ConfigError as err:
        if prefix:
            raise ConfigError(_qualify(prefix, str(err))) from None
        raise


def _qualify(prefix: str, message: str) -> str:
    """``message`` with its leading key placed under ``prefix``, without repeating the parts the
    key already names: a check written as ``verify.rtol`` under ``config.verify`` gives
    ``config.verify.rtol``, not ``config.verify.verify.rtol``."""
    key, sep, rest = message.partition(": ")
    if not sep or " " in key:
        return f"{prefix}: {message}"
    outer, inner = prefix.split("."), key.split(".")
    for overlap in range(min(len(outer), len(inner)), 0, -1):
        if outer[-overlap:] == inner[:overlap]:
            return ".".join(outer + inner[overlap:]) + sep + rest
    return f"{prefix}.{key}{sep}{rest}"


def to_dict(config: Any) -> dict[str, Any]:
    """Plain-data form of a config (tuples become lists) for YAML/JSON output."""

    def plain(value: Any) -> Any:
        if dataclasses.is_dataclass(value):
            return {f.name: plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
        if isinstance(value, (list, tuple)):
            return [plain(v) for v in value]
        if isinstance(value, dict):
            return {k: plain(v) for k, v in value.items()}
        return value

    return plain(config)


def load_yaml(path: str | Path) -> dict[str, Any]:
    """Read a YAML mapping; missing files and malformed YAML become one-line ConfigErrors."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f":{mark.line + 1}" if mark is not None else ""
        problem = getattr(err, "problem", None) or "invalid YAML"
        raise ConfigError(f"{path}{where}: {problem}") from None
    if not isinstance(data, Mapping):
        raise ConfigError(f"{path}: expected a mapping at the top level, got {type(data).__name__}")
    return dict(data)


# Where configs/... is found when the working directory has no such file: the copy a wheel
# installs inside the package (package-dir in pyproject.toml), else the checkout's own folder
# (editable installs and PYTHONPATH=checkout import distopt from the checkout).
_SHIPPED_CONFIGS = (Path(__file__).with_name("configs"), Path(__file__).parents[1] / "configs")


def find_config_file(path: str | Path) -> Path:
    """``path`` when it names a file (relative to the working directory), else the copy of
    ``configs/...`` shipped with distopt, so ``configs/jobs/ps_dlrm.yaml`` works outside a
    checkout too. Returns ``path`` unchanged when neither exists."""
    path = Path(path)
    if path.is_file() or path.is_absolute() or path.parts[:1] != ("configs",):
        return path
    for root in _SHIPPED_CONFIGS:
        shipped = root.joinpath(*path.parts[1:])
        if shipped.is_file():
            return shipped
    return path


def load_config(cls: type[T], path: str | Path, overrides: list[str] | None = None) -> T:
    """Load ``cls`` from a YAML file, applying ``key.sub=value`` overrides (values parsed as YAML)."""
    data = load_yaml(path)
    for item in overrides or []:
        apply_override(data, item)
    return from_dict(cls, data)


def apply_override(data: dict[str, Any], item: str) -> None:
    """Set the dotted ``key`` of ``key=value`` in ``data``, the value parsed as YAML."""
    if "=" not in item:
        raise ConfigError(f"override {item!r}: expected key=value")
    key, raw = item.split("=", 1)
    if not key:
        raise ConfigError(f"override {item!r}: empty key")
    try:
        value = yaml.safe_load(raw) if raw else ""
    except yaml.YAMLError as err:
        problem = " ".join(str(getattr(err, "problem", None) or "invalid YAML").split())
        raise ConfigError(f"{key}: cannot parse {raw!r} as YAML ({problem})") from None
    node = data
    parts = key.split(".")
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"override {item!r}: {part} is not a mapping")
        node = child
    node[parts[-1]] = value


def check(condition: bool, key: str, expected: str, value: Any) -> None:
    """Raise ``ConfigError("key: expected ..., got value")`` unless ``condition`` holds."""
    if not condition:
        raise ConfigError(f"{key}: expected {expected}, got {value!r}")


# --- distopt.optimize configuration ------------------------------------------------------------


@dataclasses.dataclass(kw_only=True, slots=True)
class CaptureConfig:
    leaf_modules: tuple[str, ...] = ()
    """Qualified class names (``pkg.mod.Class``) or module paths traced as single nodes."""
    leaf_functions: tuple[str, ...] = ()
    """Qualified function names (``pkg.mod.fn``) recorded as single nodes instead of traced."""
    symbolic: bool = True
    """Try symbolic tracing first (off: go straight to Dynamo)."""
    dynamo: bool = True
    """Fall back to Dynamo capture (``torch.compile``) when symbolic tracing fails."""

    def __post_init__(self) -> None:
        check(
            self.symbolic or self.dynamo, "capture", "symbolic or dynamo (or both) on", "both off"
        )


@dataclasses.dataclass(kw_only=True, slots=True)
class VerifyConfig:
    rtol: float = 1e-5
    """Relative tolerance for outputs and gradients (``torch.allclose``)."""
    atol: float = 1e-6
    """Absolute tolerance for outputs and gradients."""
    reordered_rtol: float = 1e-4
    """Relative tolerance when a kept pass computes some of the math in another floating-point
    order (BatchNorm folded into weights, channels-last kernels, fused oneDNN ops): float32
    round-off then differs from the original's, by an amount that grows with depth."""
    reordered_atol: float = 1e-4
    """Absolute tolerance in that case, times each tensor's largest magnitude (at least 1): the
    round-off of a reordered sum scales with the values summed, not with each output element."""
    check_grads: bool = True
    """Also compare parameter gradients (training-mode models; eval-mode models compare outputs)."""
    bisect: bool = True
    """On mismatch, re-run prefixes of the pass list to name the pass that broke equivalence."""
    remote_writes: bool = False
    """Let verification run a model that writes to remote state (pushes, remote calls not
    declared reads): the original's run applies each write once and the optimized run replays
    it. Off, such a model is returned unverified and the report says why."""

    def __post_init__(self) -> None:
        check(self.rtol >= 0, "verify.rtol", "a number >= 0", self.rtol)
        check(self.atol >= 0, "verify.atol", "a number >= 0", self.atol)
        check(
            self.reordered_rtol >= 0, "verify.reordered_rtol", "a number >= 0", self.reordered_rtol
        )
        check(
            self.reordered_atol >= 0, "verify.reordered_atol", "a number >= 0", self.reordered_atol
        )


@dataclasses.dataclass(kw_only=True, slots=True)
class MeasureConfig:
    """How speed choices are measured on the example inputs (:mod:`distopt.estimate.ab`).

    Passes whose gain depends on the machine (layouts, fused kernels) time the graph with and
    without their rewrite and keep it only when it is faster by ``margin``; an eval-mode model
    is returned optimized only when it is not slower than the original.
    """

    enabled: bool = True
    """Off: measured passes apply unmeasured and the optimized model is returned as it is."""
    margin: float = 0.02
    """A rewrite is kept when its median time is at least this fraction below the baseline's."""
    budget_s: float = 2.0
    """Seconds one comparison may spend timing, after its first round (slow graphs stop early)."""
    max_rounds: int = 30
    """Interleaved rounds (one call of each variant) at most per comparison."""

    def __post_init__(self) -> None:
        check(0 <= self.margin < 1, "measure.margin", "a number in [0, 1)", self.margin)
        check(self.budget_s > 0, "measure.budget_s", "a number > 0", self.budget_s)
        check(self.max_rounds >= 1, "measure.max_rounds", "an integer >= 1", self.max_rounds)


@dataclasses.dataclass(kw_only=True, slots=True)
class OptimizeConfig:
    capture: CaptureConfig = dataclasses.field(default_factory=CaptureConfig)
    verify: VerifyConfig = dataclasses.field(default_factory=VerifyConfig)
    measure: MeasureConfig = dataclasses.field(default_factory=MeasureConfig)
    passes: tuple[str, ...] | None = None
    """Pass names to run; ``None`` runs the registry's default passes."""
    pass_options: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
    """Per-pass keyword options, e.g. ``{"partition": {"num_units": 4}}``."""
    dump_graph: str | None = None
    """Write a picture of the optimized graph here (``.svg``/``.png``; needs pydot + graphviz)."""
