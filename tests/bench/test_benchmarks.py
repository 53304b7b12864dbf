"""Smoke tests of the benchmarks: they run end to end on tiny configs and write sane JSON.

Speed targets are checked by the benchmarks themselves (`distopt bench ...`), not here.
"""

import json

import pytest

from distopt.cli import main


def test_optimize_overhead_runs(tmp_path) -> None:
    config = tmp_path / "overhead.yaml"
    config.write_text("kind: optimize_overhead\nnode_counts: [50, 100]\nrepeats: 1\n")
    out = tmp_path / "out.json"
    main(["bench", str(config), "--json", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert [r["graph_nodes"] for r in rows] == [49, 99]
    assert all(r["median_s"] > 0 for r in rows)


@pytest.mark.slow
def test_ps_overlap_runs_and_logs(tmp_path) -> None:
    config = tmp_path / "ps.yaml"
    config.write_text(
        "kind: ps_overlap\ntables: [2]\nlatency_ms: [2.0]\ncompute: [light]\nrounds: 1\nsteps: 4\n"
        f"warmup: 1\nbatching_fetches: 4\noutput_dir: {tmp_path / 'runs'}\n"
    )
    out = tmp_path / "out.json"
    main(["bench", str(config), "--json", str(out)])
    result = json.loads(out.read_text())
    point = result["points"][0]
    assert set(point["variants"]) == {"baseline", "optimized", "hand"}
    assert all(v["steps"] == 3 for v in point["variants"].values())
    assert result["batching"]["fetches"] == 4 and result["batching"]["batched_s"] > 0
    logs = sorted(p.parent.name.rsplit("-", 1)[-1] for p in (tmp_path / "runs").glob("*/qps-rank0.jsonl"))
    assert logs == ["baseline", "hand", "optimized"]


def test_unknown_kind_is_a_one_line_error(tmp_path, capsys) -> None:
    config = tmp_path / "x.yaml"
    config.write_text("kind: nope\n")
    assert main(["bench", str(config)]) == 2
    assert "kind: unknown benchmark 'nope'" in capsys.readouterr().err
