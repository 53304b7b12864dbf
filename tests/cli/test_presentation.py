"""What the command line shows a user when its output is not a terminal (a pipe, a file, a CI log):
``distopt explain`` neither wraps nor pads nor breaks generated code, says "unchanged" when no pass
changed anything, counts in proper plurals; ``--help`` is plain text; ``distopt coverage`` prints
only its own lines."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from distopt.cli import build_parser
from tests import shell

SUBCOMMANDS = ["explain", "bench", "compare", "demo", "coverage", "train", "launch"]


def _distopt(*args: str) -> subprocess.CompletedProcess[str]:
    # COLUMNS as a narrow terminal sets it: output into a pipe must not follow it.
    proc = shell.run("distopt", *args, cwd=Path.cwd(), env={"COLUMNS": "80"}, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


@pytest.mark.slow
def test_explain_into_a_pipe_keeps_every_line_whole() -> None:
    out = _distopt("explain", "dlrm", "--ps-latency-ms", "1").stdout
    lines = out.splitlines()
    assert [line for line in lines if line != line.rstrip()] == []  # no padding
    batched = [line for line in lines if line.startswith("+    fetch_batched = ")]
    assert len(batched) == 1 and batched[0].endswith("getitem_3 = None"), (
        batched
    )  # one statement, one line
    assert max(map(len, lines)) > 110  # nothing wrapped at a console width
    assert lines[0] == "distopt DLRM: optimized"
    assert "merged 4 remote reads into 1 batched request " in out
    assert "split 4 remote calls into issue + wait" in out


def test_explain_says_when_no_pass_changed_anything() -> None:
    out = _distopt("explain", "mlp").stdout
    assert out.splitlines()[0] == "distopt MLP: captured, unchanged: no pass changed the graph"
    assert "removed 0 no-op calls" in out and "generated code unchanged by the passes" in out
    assert "verification passed (outputs and gradients): " in out


@pytest.mark.parametrize("command", [None, *SUBCOMMANDS])
def test_help_is_plain_text(command: str | None) -> None:
    parser = build_parser()
    if command is not None:
        parser = next(a for a in parser._actions if a.dest == "command").choices[command]
    text = parser.format_help()
    assert (
        "``" not in text and ":func:" not in text and ":class:" not in text and "`" not in text
    ), text


def test_launch_help_reads_as_plain_text() -> None:
    text = _distopt("launch", "--help").stdout
    assert (
        "distopt launch JOB.yaml [-s SCHEDULER] [--cfg k=v,...] [--set k=v ...]: submit"
        in " ".join(text.split())
    )
    assert "(distopt.launch)" in text


def test_coverage_prints_only_its_own_lines() -> None:
    pytest.importorskip("deepctr_torch")
    proc = _distopt("coverage", "--only", "deepfm")
    out = proc.stdout.splitlines()
    assert out[0] == "optimizing deepctr-torch:deepfm…"
    assert (
        out[-1]
        == "1 models: 1 symbolic_trace, 0 dynamo, 0 eager_fallback; correct model returned for 1/1"
    )
    assert not any("version" in line.lower() or "pypi" in line.lower() for line in out), out
    assert proc.stderr == ""
