import subprocess
import sys
from pathlib import Path

import pytest

from distopt.cli import main
from tests import shell
from tests.noise import noise


def test_explain_registered_model(capsys) -> None:
    assert main(["explain", "mlp", "--no-code"]) == 0
    out = capsys.readouterr().out
    assert "capture tier: symbolic_trace" in out and "verification passed" in out


def test_explain_factory_path(capsys) -> None:
    assert main(["explain", "tests.cli.factories:tiny"]) == 0
    assert "Tiny" in capsys.readouterr().out


def test_unknown_model_is_one_line_error(capsys) -> None:
    assert main(["explain", "no_such_model"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("distopt explain: error: model: unknown model 'no_such_model'")
    assert "\n" not in err


def test_module_entry_point_runs() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "distopt", "--help"], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0 and "explain" in proc.stdout


def test_ps_latency_needs_a_ps_model(capsys) -> None:
    assert main(["explain", "mlp", "--ps-latency-ms", "1"]) == 2
    assert capsys.readouterr().err == (
        "distopt explain: error: --ps-latency-ms: 'mlp' is not a parameter-server model (MLP has "
        "no ps_tables() method)\n"
    )


@pytest.mark.slow
def test_ps_model_prediction_next_to_measurement(capsys) -> None:
    args = ["explain", "dlrm", "--ps-latency-ms", "2", "--no-code"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "merged 4 remote reads into 1 batched request" in out
    assert "cost model: predicted forward" in out
    assert "measured forward (median of 25, interleaved)" in out


RANKER = """
import torch
from torch import nn

import distopt.ps as ps


class Ranker(nn.Module):
    def __init__(self):
        super().__init__()
        self.users = ps.RemoteEmbedding("users", 4)
        self.head = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 1))

    def forward(self, dense, user_id, item):
        return self.head(torch.cat([dense, self.users(user_id) * ps.fetch("items", item)], 1))

    def ps_tables(self):
        return [ps.TableSpec(name="users", num_rows=50, dim=4),
                ps.TableSpec(name="items", num_rows=20, dim=4)]


def build():
    return Ranker()


def with_inputs():
    gen = torch.Generator().manual_seed(0)
    ids = lambda rows: torch.randint(0, rows, (16,), generator=gen)  # noqa: E731
    return Ranker(), (torch.randn(16, 2, generator=gen), ids(50), ids(20))
"""


def _ranker_package(where: Path) -> Path:
    """A user's package ``recjob`` in ``where`` (outside the repository)."""
    (where / "recjob").mkdir()
    (where / "recjob" / "__init__.py").write_text("")
    (where / "recjob" / "ranker.py").write_text(RANKER)
    return where


def test_ps_latency_without_example_inputs_says_what_is_needed(tmp_path: Path) -> None:
    """A new user's trial: a factory returning the model alone was 'not a parameter-server model
    (no ps_tables())', which it is."""
    proc = shell.run(
        "distopt", "explain", "recjob.ranker:build", "--ps-latency-ms", "2",
        cwd=_ranker_package(tmp_path), timeout=300,
    )  # fmt: skip
    assert proc.returncode == 2 and proc.stdout == "", proc.stderr[-3000:]
    assert proc.stderr == (
        "distopt explain: error: --ps-latency-ms: 'recjob.ranker:build' gives no example inputs "
        "to time the forward on: make the factory return (model, example_inputs), or give Ranker "
        "an example_inputs(batch_size, seed) method\n"
    )


@pytest.mark.slow
def test_ps_latency_with_a_factory_of_model_and_inputs(tmp_path: Path) -> None:
    """What the error above asks for works; fold_conv_bn's reason is the real one (no pair)."""
    proc = shell.run(
        "distopt", "explain", "recjob.ranker:with_inputs", "--ps-latency-ms", "2", "--no-code",
        cwd=_ranker_package(tmp_path), timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0 and noise(proc.stderr) == [], proc.stderr[-3000:]
    (fold,) = [line for line in proc.stdout.splitlines() if "│ fold_conv_bn " in line]
    assert "no convolution followed by BatchNorm to fold" in fold, fold
    assert "verification passed (outputs and gradients)" in proc.stdout
    assert "merged 2 remote reads into 1 batched request" in proc.stdout
    assert "cost model: predicted forward" in proc.stdout
