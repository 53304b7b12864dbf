"""Ctrl-C ends a command as "interrupted" (exit 130), even where PyTorch turned the interrupt
into the failure of a remote call before it reached the command line."""

from __future__ import annotations

import argparse
import os
import signal

import pytest

import distopt.cli as cli
from distopt.errors import RemoteCallError


def _parser_running(func) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="distopt")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("job").set_defaults(func=func)
    return parser


@pytest.fixture
def python_handles_ctrl_c():
    """Python's own SIGINT handler, as in a program started from a terminal (a background job
    of a script starts with SIGINT ignored, and the command line leaves that as it is)."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def test_an_interrupt_that_became_a_remote_call_error_ends_as_interrupted(
    monkeypatch, capsys, python_handles_ctrl_c
) -> None:
    def job(_args) -> int:
        try:
            os.kill(os.getpid(), signal.SIGINT)  # Python raises it at the next bytecode: here
            for _ in range(1000):
                pass
        except KeyboardInterrupt as err:  # what PyTorch does with it inside an RPC callback
            raise RemoteCallError(f"fetch failed: RuntimeError: {type(err).__name__}") from None
        return 0

    monkeypatch.setattr(cli, "build_parser", lambda: _parser_running(job))
    assert cli.main(["job"]) == 128 + signal.SIGINT
    assert capsys.readouterr().err == "distopt job: interrupted\n"
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # put back


def test_without_an_interrupt_an_error_is_the_error(monkeypatch, capsys, python_handles_ctrl_c):
    def job(_args) -> int:
        raise RemoteCallError("fetch failed: the server is gone")

    monkeypatch.setattr(cli, "build_parser", lambda: _parser_running(job))
    assert cli.main(["job"]) == 2
    assert capsys.readouterr().err == "distopt job: error: fetch failed: the server is gone\n"


def test_a_callers_own_handler_stays(monkeypatch) -> None:
    seen: list[int] = []

    def own(signum: int, _frame: object) -> None:
        seen.append(signum)

    previous = signal.signal(signal.SIGINT, own)
    try:
        monkeypatch.setattr(cli, "build_parser", lambda: _parser_running(lambda _args: 0))
        assert cli.main(["job"]) == 0
        assert signal.getsignal(signal.SIGINT) is own
        os.kill(os.getpid(), signal.SIGINT)
        assert seen == [signal.SIGINT]
    finally:
        signal.signal(signal.SIGINT, previous)
