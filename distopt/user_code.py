"""The user's code named by module path, ``package.module:attribute``: model factories, data
factories, the functions a parameter server runs.

A job's processes run ``python -m distopt.train`` in the job's working directory (on
``local_cwd``, the directory it was launched from), so Python finds the user's packages there. The
process that launches or checks the job resolves names the same way: when a package is not found
on ``sys.path``, the working directory is added (at the end, so it never shadows an installed
package) and the import tried again. ``python examples/own_model/run.py`` then finds
``examples.own_model.model`` as the job's processes will, though Python put only the script's
folder on the path.
"""

from __future__ import annotations

import importlib
import os
import sys
from types import ModuleType
from typing import Any

from distopt.errors import ConfigError
from distopt.where import describe_failure


def import_module(name: str) -> ModuleType:
    """``importlib.import_module(name)``, looking in the working directory too (module docstring)."""
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as err:
        cwd = os.getcwd()
        # Only the package itself missing; a missing dependency of the user's module stays an error.
        missing_package = err.name is not None and (
            name == err.name or name.startswith(f"{err.name}.")
        )
        if not missing_package or cwd in sys.path or "" in sys.path:
            raise
        sys.path.append(cwd)
        importlib.invalidate_caches()
        return importlib.import_module(name)


def load(spec: str, *, key: str) -> Any:
    """The object ``package.module:function`` names; a one-line :class:`ConfigError` naming
    ``key`` when it is malformed, does not import, or its module raises while importing."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ConfigError(f"{key}: expected 'package.module:function', got {spec!r}")
    try:
        obj: Any = import_module(module_name)
        for part in attr.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as err:
        raise ConfigError(f"{key}: cannot import {spec!r} ({type(err).__name__}: {err})") from None
    except Exception as err:  # the module itself raised: a SyntaxError, a missing variable
        raise ConfigError(
            f"{key}: importing {module_name!r} for {spec!r} failed: {describe_failure(err)}"
        ) from None
    return obj


__all__ = ["import_module", "load"]
