import subprocess
import sys

import pytest

from distopt.cli import main


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
    assert "is not a parameter-server model" in capsys.readouterr().err


@pytest.mark.slow
def test_ps_model_prediction_next_to_measurement(capsys) -> None:
    args = ["explain", "dlrm", "--ps-latency-ms", "2", "--no-code"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "merged 4 remote reads into 1 batched request" in out
    assert "cost model: predicted step" in out
    assert "measured forward (median of 25, interleaved)" in out
