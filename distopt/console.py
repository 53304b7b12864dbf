"""The rich console every distopt command prints tables with."""

from __future__ import annotations

from rich.console import Console

PIPED_WIDTH = 200
"""Width when output goes to a file or a CI log: rich's default of 80 columns would truncate the
cells of wide tables ("1531 [953–…"), and a log is read later, not on a narrow terminal."""


def console() -> Console:
    """A terminal-sized console, or a :data:`PIPED_WIDTH`-wide one when stdout is not a terminal."""
    plain = Console()
    return plain if plain.is_terminal else Console(width=PIPED_WIDTH)
