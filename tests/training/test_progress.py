"""Progress: a bar on a terminal, periodic plain lines otherwise, silence on ranks other than 0."""

from __future__ import annotations

import io
import logging

import pytest

from distopt.training.progress import Progress


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def _run(stream: io.StringIO, *, rank: int = 0, total: int = 10, log_every: int = 4) -> str:
    progress = Progress(total=total, rank=rank, log_every=log_every, stream=stream)
    for step in range(total):
        progress.update(step, loss=0.5, qps=1234.0)
    progress.close()
    return stream.getvalue()


def test_log_records_without_a_terminal(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="distopt.training.progress"):
        assert _run(io.StringIO()) == ""
    lines = [r.getMessage() for r in caplog.records]
    assert [line.split(" loss")[0] for line in lines] == ["step 4/10", "step 8/10", "step 10/10"]
    assert "qps 1,234.0" in lines[0]


def test_bar_on_a_terminal() -> None:
    out = _run(_Terminal())
    assert "trainer 0" in out and "10/10" in out and "\r" in out
    assert "[trainer 0] step" not in out


def test_other_ranks_are_silent(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="distopt.training.progress"):
        assert _run(io.StringIO(), rank=1) == ""
    assert not caplog.records
    assert _run(_Terminal(), rank=1) == ""
