"""``distopt`` command line. Each subcommand lives in its own module of this package and exposes
``add_parser(subparsers)`` (which sets ``func`` on its parser) — add new ones to ``_SUBCOMMANDS``."""

from __future__ import annotations

import argparse
import importlib
import os
import re
import signal
import sys
import threading

from distopt.errors import DistoptError

_SUBCOMMANDS = (
    "distopt.cli.cmd_explain",
    "distopt.cli.cmd_bench",
    "distopt.cli.cmd_compare",
    "distopt.cli.cmd_demo",
    "distopt.cli.cmd_coverage",
    "distopt.cli.cmd_train",
    "distopt.cli.cmd_launch",
    "distopt.cli.cmd_data",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="distopt", description="Graph rewrites that make distributed training faster."
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module_name in _SUBCOMMANDS:
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as err:
            if err.name == module_name:
                continue  # subcommand not built yet
            raise
        module.add_parser(sub)
    for command in sub.choices.values():  # descriptions come from docstrings
        command.description = plain(command.description)
        for action in command._actions:
            action.help = plain(action.help)
    return parser


_ROLE = re.compile(r":[a-z]+:`~?([^`]+)`")
_LITERAL = re.compile(r"``([^`]+)``|`([^`]+)`")


def plain(text: str | None) -> str | None:
    """reStructuredText of a docstring as plain text for ``--help``: ``:func:`distopt.launch```
    → ``distopt.launch``, double and single back-quoted literals → their text."""
    if text is None:
        return None
    text = _ROLE.sub(lambda m: m.group(1), text)
    return _LITERAL.sub(lambda m: m.group(1) or m.group(2), text)


class _Interrupts:
    """Whether Ctrl-C came while a command ran. Python raises its KeyboardInterrupt wherever the
    main thread runs Python next, which can be a callback PyTorch calls (an RPC answer being
    unpickled): PyTorch then turns it into the call's error, and the command would fail with
    "remote call failed" where the user pressed Ctrl-C."""

    def __init__(self) -> None:
        self.seen = False
        self._installed = False

    def __enter__(self) -> _Interrupts:
        # Only over Python's own handler, in the main thread (the only one that may set one): a
        # caller's handler (a test's, an embedding program's) stays.
        if (
            threading.current_thread() is threading.main_thread()
            and signal.getsignal(signal.SIGINT) is signal.default_int_handler
        ):
            signal.signal(signal.SIGINT, self._interrupt)
            self._installed = True
        return self

    def __exit__(self, *exc: object) -> None:
        # Unless the command set a handler of its own meanwhile.
        if self._installed and signal.getsignal(signal.SIGINT) == self._interrupt:
            signal.signal(signal.SIGINT, signal.default_int_handler)

    def _interrupt(self, signum: int, frame: object) -> None:
        self.seen = True
        raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    # Models, datasets and benchmark factories are named by module path (``mypkg.models:make``):
    # find them in the current directory, as ``python -m`` would.
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    args = build_parser().parse_args(argv)
    with _Interrupts() as interrupts:
        try:
            return int(args.func(args) or 0)
        except (DistoptError, FileNotFoundError) as err:
            if interrupts.seen:  # the error Ctrl-C became on its way out (see _Interrupts)
                return _interrupted(args.command)
            if isinstance(err, FileNotFoundError):
                print(
                    f"distopt {args.command}: error: {err.strerror}: {err.filename}",
                    file=sys.stderr,
                )
            else:
                print(f"distopt {args.command}: error: {err}", file=sys.stderr)
            return 2
        except KeyboardInterrupt:  # Ctrl-C: what was started has been stopped on the way out
            return _interrupted(args.command)


def _interrupted(command: str) -> int:
    print(f"distopt {command}: interrupted", file=sys.stderr)
    return 128 + signal.SIGINT


if __name__ == "__main__":
    sys.exit(main())
