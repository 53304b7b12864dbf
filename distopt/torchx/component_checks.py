"""Checks the TorchX components run on the submitting machine, so bad input fails before anything
is scheduled: every error is one line that starts with the flag, e.g.
``--set: stpes: unknown key (known keys: ...)``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torchx.specs.finder import ComponentValidationException

from distopt.config import apply_override, from_dict, load_yaml
from distopt.errors import ConfigError

__all__ = ["ComponentArgError", "check_port", "check_positive", "checked_config", "join_set_items"]


class ComponentArgError(ConfigError, ComponentValidationException):
    """A component argument is invalid; the message names the flag.

    Also a TorchX ``ComponentValidationException``, so ``torchx run`` prints the one-line
    message and exits 1 instead of showing a traceback.
    """


def checked_config(
    config: str,
    items: Sequence[str] | None,
    output_dir: str | None,
    *,
    schema: type[Any] | None,
) -> tuple[list[str], Any]:
    """Check the config file and the ``--set`` overrides; returns the overrides to pass on and the
    merged config (``None`` without a ``schema``).

    With a ``schema`` (a config dataclass) the merged config is built with
    :func:`distopt.config.from_dict`, so unknown keys and ill-typed values are refused here
    rather than in every replica after scheduling.
    """
    if not config:
        raise ComponentArgError("--config: a config file path is required")
    try:
        data = load_yaml(config)
    except ConfigError as err:
        raise ComponentArgError(f"--config: {err}") from None
    flags = [("--set", item.strip()) for item in join_set_items(items or []) if item.strip()]
    if output_dir:
        flags.append(("--output_dir", f"output_dir={output_dir}"))
    for flag, item in flags:
        try:
            apply_override(data, item)
        except ConfigError as err:
            raise ComponentArgError(f"{flag}: {err}") from None
    built = None
    if schema is not None:
        try:
            built = from_dict(schema, data)
        except ConfigError as err:
            raise ComponentArgError(f"{_flag_of(str(err), flags, config)}: {err}") from None
    return [item for _, item in flags], built


def _flag_of(message: str, flags: list[tuple[str, str]], config: str) -> str:
    """Which input the key at the start of ``message`` came from: an override, else the file."""
    key = message.partition(": ")[0]
    for flag, item in reversed(flags):  # the last override of a key is the one that counts
        name = item.partition("=")[0]
        if key == name or key.startswith((name + ".", name + "[")):
            return flag
    return f"--config: {config}"


def join_set_items(items: Sequence[str]) -> list[str]:
    """Undo TorchX's comma split inside brackets.

    TorchX parses ``--set`` (``List[str]``) by splitting its value on commas, so
    ``--set model_kwargs.sizes=[8,4],steps=5`` arrives as
    ``['model_kwargs.sizes=[8', '4]', 'steps=5']``; pieces are joined back until the brackets
    balance. An item still unbalanced at the end is left as it is for the YAML parser to refuse.
    """
    joined: list[str] = []
    open_brackets = 0
    for piece in items:
        if open_brackets > 0:
            joined[-1] += "," + piece
        else:
            joined.append(piece)
        item = joined[-1]
        open_brackets = sum(item.count(c) for c in "[{") - sum(item.count(c) for c in "]}")
    return joined


def check_positive(flag: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ComponentArgError(f"{flag}: expected an integer >= 1, got {value!r}")


def check_port(flag: str, value: int) -> None:
    # ps_job also uses value + 1, so the top port is excluded.
    if not 1 <= value < 65535:
        raise ComponentArgError(f"{flag}: expected a port in 1..65534, got {value!r}")
