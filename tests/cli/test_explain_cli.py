import subprocess
import sys

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
    proc = subprocess.run([sys.executable, "-m", "distopt", "--help"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "explain" in proc.stdout
