"""docs/own_job.md, and the acceptance scenario of bringing your own job: the page's files are
the package ``tests/user_jobs/kv_recsys`` (own ``rpc_sync`` tables, ``ps_tables()`` returning
``[]``, a Dataset with attributes ``user``, ``item``, ``shop``, own factories), and every command
on the page runs, from the page's files written outside the repository: both variants launch
with ``distopt launch job.yaml --set variant=...`` on local_cwd and succeed, and ``distopt
compare`` shows the optimized variant's gain with its confidence interval.

Two things differ from a user's shell: each launch gets a free ``--arg master_port`` (tests run
in parallel; the default is 29500) and keeps its replica logs under ``runs/torchx``."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from distopt.dist.rendezvous import free_port
from distopt.metrics import load_run
from tests.user_jobs.as_user import HERE, distopt_cli, trainer_log

DOC = HERE.parents[1] / "docs" / "own_job.md"
PACKAGE = HERE / "kv_recsys"
_BLOCK = re.compile(r'^```(\w*)(?: title="([^"]+)")?\n(.*?)^```$', re.M | re.S)


def _blocks() -> list[tuple[str, str | None, str]]:
    """``(language, title, text)`` of every fenced block of the page."""
    return [(lang, title, text) for lang, title, text in _BLOCK.findall(DOC.read_text())]


def test_the_files_on_the_page_are_the_tested_package() -> None:
    shown = {title: text for _, title, text in _blocks() if title}
    assert sorted(shown) == ["job.yaml", "kvrec/data.py", "kvrec/model.py", "kvrec/store.py"]
    for title, text in shown.items():
        assert (PACKAGE / title).read_text() == text, title
    tree = next(text for lang, title, text in _blocks() if not lang)
    listed = {
        line.split("─ ")[1].split()[0].rstrip("/") for line in tree.splitlines() if "─ " in line
    }
    assert listed == {p.name for p in PACKAGE.rglob("*") if "__pycache__" not in p.parts}
    assert (PACKAGE / "kvrec" / "__init__.py").read_text() == ""  # "empty", as the tree says


@pytest.mark.slow
def test_every_command_on_the_page_runs_outside_the_repository(tmp_path: Path) -> None:
    work = tmp_path / "shop-ranker"
    (work / "kvrec").mkdir(parents=True)
    (work / "kvrec" / "__init__.py").write_text("")
    for _, title, text in _blocks():
        if title:
            (work / title).write_text(text)
    outputs = []
    for lang, title, text in _blocks():
        if lang == "python" and not title:  # a snippet, run where the package is
            proc = subprocess.run(
                [sys.executable, "-c", text], cwd=work, capture_output=True, text=True
            )
            assert proc.returncode == 0, proc.stderr
            outputs.append(proc.stdout)
        elif lang == "bash":
            for line in text.splitlines():
                args = shlex.split(line)
                assert args[0] == "distopt", line
                if args[1] == "launch":
                    run_id = args[args.index("--run-id") + 1]
                    args += [
                        "--arg",
                        f"master_port={free_port(consecutive=2)}",
                        "--cfg",
                        f"log_dir=runs/torchx/{run_id}",
                    ]
                proc = distopt_cli(*args[1:], cwd=work)
                assert proc.returncode == 0, (line, proc.stdout[-3000:], proc.stderr[-3000:])
                assert "Traceback" not in proc.stderr, proc.stderr
                outputs.append(proc.stdout)
    assert outputs[0] == "[(4, 4), (4,), (4,), (4,)] (4, 1)\n"  # the data snippet
    table = outputs[-1]
    assert "gain [95% CI]" in table and re.search(r"\d\.\d+× \[\d\.\d+, \d\.\d+\]", table), table

    runs = {v: load_run(work / "runs" / v) for v in ("baseline", "optimized")}
    for run in runs.values():
        assert run.world_size == 2 and run.ranks[0].evals[-1].metrics["eval_auc"] > 0.65
    # The same model and data give the same first loss. Not bitwise: the job is not deterministic,
    # so one trainer's first `add` can reach the shared store before the other's first `get` (a
    # race of the user's own async training, in either variant: CI saw 0.70725340 vs 0.70725322).
    # Such an update moves a loss by ~1e-7; a model computed differently would move it by far more.
    baseline_first = [r.steps[0].loss for r in runs["baseline"].ranks.values()]
    optimized_first = [r.steps[0].loss for r in runs["optimized"].ranks.values()]
    assert optimized_first == pytest.approx(baseline_first, rel=1e-5), (
        baseline_first,
        optimized_first,
    )
    header = runs["optimized"].header
    assert header["predicted_rpc_latency_s"] >= 0.005  # the store's own lookups, timed
    log = trainer_log(work, "optimized")
    assert (
        "optimize: ShopRanker optimized (symbolic_trace; changed by split_remote, hoist_issue, "
        "sink_wait); verification passed (outputs only)"
    ) in log

    compared = distopt_cli(
        "compare", "runs/baseline", "runs/optimized", "--json", "compare.json", cwd=work
    )
    assert compared.returncode == 0, compared.stderr
    optimized = json.loads((work / "compare.json").read_text())["runs"][1]
    # What the page promises is a gain with its interval, not its size: a 60-step job timed beside
    # another test is at the mercy of the neighbour (CI measured 0.85× where a quiet host gives
    # 1.64× [1.58, 1.72]). How fast the rewritten job is lives in benchmarks (remote_idioms, demo).
    assert optimized["variant"] == "optimized", optimized
    assert 0 < optimized["gain_ci_low"] <= optimized["gain"] <= optimized["gain_ci_high"], optimized
    assert optimized["predicted_gain"] > 0, optimized


README = HERE.parents[1] / "README.md"


def test_the_readme_example_runs_quietly_outside_the_repository(tmp_path: Path) -> None:
    """The README's Python block, as a user pastes it: it runs, and prints no warning."""
    (snippet,) = [text for lang, _, text in _BLOCK.findall(README.read_text()) if lang == "python"]
    proc = subprocess.run(
        [sys.executable, "-c", snippet], cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr
    assert "Warning" not in proc.stderr, proc.stderr
    assert "verification passed" in proc.stdout, proc.stdout
