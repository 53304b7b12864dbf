"""Wording shared by reports and messages."""

from __future__ import annotations


def plural(count: int, noun: str, plural_form: str | None = None) -> str:
    """``"1 request"``, ``"2 requests"``; ``plural_form`` for nouns that take more than an -s."""
    return f"{count} {noun if count == 1 else plural_form or noun + 's'}"


__all__ = ["plural"]
