"""Exceptions raised by distopt. Every message is one line naming the offending thing."""

from __future__ import annotations

import sys


class DistoptError(Exception):
    """Base class of every error distopt raises on purpose."""


class ConfigError(DistoptError, ValueError):
    """A configuration key or value is invalid; the message names the key and the value."""


class CaptureError(DistoptError):
    """No capture tier produced a graph and ``strict=True`` forbids falling back."""


class PassError(DistoptError):
    """A graph pass raised; the message names the pass and the passes that ran before it."""

    def __init__(self, message: str, *, pass_name: str, passes_before: tuple[str, ...]) -> None:
        super().__init__(message)
        self.pass_name = pass_name
        self.passes_before = passes_before


class VerificationError(DistoptError):
    """The optimized model's outputs or gradients differ from the original's."""

    def __init__(self, message: str, *, culprit: str | None = None) -> None:
        super().__init__(message)
        self.culprit = culprit


class RemoteCallError(DistoptError, RuntimeError):
    """A remote (parameter-server) call failed; raised at the wait with the server's message."""


class DistoptFallbackWarning(UserWarning):
    """distopt returned (part of) the original model unoptimized; the message says why."""


class DistoptUnverifiedWarning(UserWarning):
    """distopt could not check (part of) an optimized model, and only the user can change that:
    the message names the remote function to declare and how. Given once per function."""


def extra_missing(err: ModuleNotFoundError, *, extra: str, key: str) -> ConfigError:
    """The one-line error for ``key``'s choice when its optional dependency ``extra`` (a module,
    and the name of distopt's extra that installs it) is not installed; ``err`` itself when a
    different module is missing (a broken installation is not a missing extra)."""
    if (err.name or "").split(".")[0] != extra:
        raise err
    return ConfigError(
        f"{key} needs {extra}, which is not installed in {sys.executable}: "
        f"pip install 'distopt[{extra}]'"
    )
