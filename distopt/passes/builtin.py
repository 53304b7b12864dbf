"""Imports every built-in pass module so each registers itself (see distopt.passes.base)."""

from distopt.passes import remove_identity  # noqa: F401
