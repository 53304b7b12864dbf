"""Progress: a bar on a terminal, periodic plain lines otherwise, silence on ranks other than 0."""

from __future__ import annotations

import io

from distopt.job.progress import Progress


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def _run(stream: io.StringIO, *, rank: int = 0, total: int = 10, log_every: int = 4) -> str:
    progress = Progress(total=total, rank=rank, log_every=log_every, stream=stream)
    for step in range(total):
        progress.update(step, loss=0.5, qps=1234.0)
    progress.close()
    return stream.getvalue()


def test_plain_lines_without_a_terminal() -> None:
    lines = _run(io.StringIO()).splitlines()
    assert [line.split(" loss")[0] for line in lines] == [
        "[trainer 0] step 4/10", "[trainer 0] step 8/10", "[trainer 0] step 10/10",
    ]  # fmt: skip
    assert "qps 1,234.0" in lines[0]


def test_bar_on_a_terminal() -> None:
    out = _run(_Terminal())
    assert "trainer 0" in out and "10/10" in out and "\r" in out
    assert "[trainer 0] step" not in out


def test_other_ranks_are_silent() -> None:
    assert _run(io.StringIO(), rank=1) == ""
    assert _run(_Terminal(), rank=1) == ""
