"""Smoke tests of the benchmarks: they run end to end on tiny configs and write sane JSON.

Speed targets are checked by the benchmarks themselves (`distopt bench ...`), not here.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from distopt.cli import main
from tests.noise import noise

REPO = Path(__file__).resolve().parents[2]


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
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        main(["bench", str(config), "--json", str(out)])
        # The trainer ran on one thread (config threads: 1) and the caller's count is back.
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(threads)
    result = json.loads(out.read_text())
    assert result["config"]["threads"] == 1 and result["trainer_threads"] == 1
    point = result["points"][0]
    variants = ["baseline", "hand", "no_network", "optimized", "pipelined"]
    assert sorted(point["variants"]) == variants
    assert all(v["steps"] == 3 for v in point["variants"].values())
    assert result["batching"]["fetches"] == 4 and result["batching"]["batched_s"] > 0
    logs = {
        p.parent.name.rsplit("-", 1)[-1]: p for p in (tmp_path / "runs").glob("*/qps-rank0.jsonl")
    }
    assert sorted(logs) == variants
    # Each predicted variant's log header carries its step, phase by phase, beside the baseline's.
    header = json.loads(logs["optimized"].read_text().splitlines()[0])
    assert header["predicted_gain"] == point["prediction"]["optimized"]["predicted_gain"]
    assert header["predicted_step_time_s"] == point["predicted_step_s"]["optimized"] > 0
    assert header["predicted_phases"]["baseline"] == point["predicted_phases"]["baseline"]
    assert "predicted_pipeline_staleness" not in header
    piped = json.loads(logs["pipelined"].read_text().splitlines()[0])
    # auto: per point the cost model's choice, deepened in the run while reads were late.
    assert piped["predicted_pipeline_staleness"] == point["predicted_pipeline_staleness"] >= 1
    assert point["predicted_pipeline_staleness"] <= point["pipeline_staleness"] <= 4
    assert piped["predicted_step_time_s"] == point["predicted_step_s"]["pipelined"] > 0
    for name in ("optimized", "pipelined"):
        score = point["prediction"][name]
        measured = (
            point["variants"]["baseline"]["median_step_s"]
            / point["variants"][name]["median_step_s"]
        )
        assert score["measured_gain"] == pytest.approx(measured)
        assert score["error"] == pytest.approx(score["predicted_gain"] / measured - 1)
    assert point["pipelined_vs_no_network_qps"] > 0 and point["pipelined_vs_optimized_qps"] > 0
    # Measured beside predicted, phase by phase.
    for phases in point["measured_phases"].values():
        assert phases["forward"] > 0 and phases["backward"] > 0
        assert 0 <= phases["waits"] <= phases["forward"]
    # The baseline waits for its pushes; the pipeline's reads are in flight when it takes a batch.
    assert (
        point["measured_phases"]["pipelined"]["waits"]
        < point["measured_phases"]["baseline"]["waits"]
    )
    lines = logs["pipelined"].read_text().splitlines()[1:]
    records = [r for r in map(json.loads, lines) if r["type"] == "step"]
    assert len(records) == 3 and all(r["phases"]["forward"] > 0 for r in records)
    # Each step's disjoint phases fit in it (its time also holds the loop between them).
    disjoint = ("data", "forward", "backward", "pushes", "optimizer")
    assert all(sum(r["phases"][p] for p in disjoint) <= r["step_time_s"] for r in records)


@pytest.mark.slow
def test_ps_overlap_adds_rounds_until_each_variant_has_its_seconds(tmp_path, capsys) -> None:
    config = tmp_path / "ps.yaml"
    config.write_text(  # 30 s per variant is out of reach: the rounds stop at max_rounds
        "kind: ps_overlap\ntables: [1]\nlatency_ms: [1.0]\ncompute: [light]\nrounds: 1\nsteps: 3\n"
        "warmup: 1\nmin_variant_s: 30\nmax_rounds: 3\nvariants: [baseline, optimized, hand]\n"
        f"warmup_rounds: 2\nchunk_s: 0.04\nbatching_fetches: 0\noutput_dir: {tmp_path / 'runs'}\n"
    )
    out = tmp_path / "out.json"
    main(["bench", str(config), "--json", str(out)])
    point = json.loads(out.read_text())["points"][0]
    # The warm-up rounds ran first and are in neither the rounds nor the steps.
    printed = capsys.readouterr().out
    assert printed.index("warm-up round 2/2 (untimed)") < printed.index("round 1/1")
    assert point["rounds"] == 3
    # Steps of a few ms: each chunk ran as many more than 3 as 0.04 s takes, as printed.
    chunks = point["chunk_steps"]
    assert all(3 < steps <= 1 + 40 for steps in chunks.values()), chunks
    assert f"chunks of ≥ 0.04 s: baseline {chunks['baseline']} steps" in printed
    assert all(v["steps"] == 3 * (chunks[n] - 1) for n, v in point["variants"].items())
    assert 0 <= point["hand_faster_rounds"] <= 3
    if (
        point["hidden_fraction"] is not None
    ):  # scored only where hand beat baseline in >= 90% of rounds
        assert point["hand_faster_rounds"] == 3


@pytest.mark.slow
def test_ps_overlap_runs_more_rounds_only_while_a_target_is_undecided(tmp_path, capsys) -> None:
    """At K = 1 the three models run one schedule: optimized/hand sits at 1.0, the target set
    here, so its interval holds it and the point runs more rounds, up to 3 × the planned 2."""
    config = tmp_path / "ps.yaml"
    config.write_text(
        "kind: ps_overlap\ntables: [1]\nlatency_ms: [1.0]\ncompute: [light]\nrounds: 2\nsteps: 4\n"
        "warmup: 1\nvariants: [baseline, optimized, hand]\ntarget_ratio_vs_hand: 1.0\n"
        f"undecided_factor: 3\nbatching_fetches: 0\noutput_dir: {tmp_path / 'runs'}\n"
    )
    out = tmp_path / "out.json"
    main(["bench", str(config), "--json", str(out)])
    point = json.loads(out.read_text())["points"][0]
    printed = capsys.readouterr().out
    assert point["planned_rounds"] == 2
    assert 2 <= point["rounds"] <= 6
    assert all(v["steps"] == point["rounds"] * 3 for v in point["variants"].values())
    low, high = point["intervals"]["optimized/hand"]
    assert low <= point["opt_vs_hand_qps"] <= high
    # It stopped at the cap, or where the interval no longer held the target.
    assert point["rounds"] == 6 or not low < 1.0 <= high
    # One line per extra round, naming what is still undecided: optimized/hand, or H as well
    # when the baseline-hand gap is wide enough for H to be scored (the order varies by run).
    undecided_lines = [line for line in printed.splitlines() if line.startswith("  undecided: ")]
    assert len(undecided_lines) == point["rounds"] - 2
    assert all("optimized/hand" in line or "H [" in line for line in undecided_lines)


def test_ps_overlap_config_errors_name_the_key() -> None:
    from distopt.bench.ps_overlap import PSOverlapConfig
    from distopt.config import from_dict
    from distopt.errors import ConfigError

    with pytest.raises(ConfigError, match=r"max_rounds.*rounds \(8\)"):
        from_dict(PSOverlapConfig, {"rounds": 8, "max_rounds": 4})
    with pytest.raises(ConfigError, match=r"h_consistency"):
        from_dict(PSOverlapConfig, {"h_consistency": 1.5})
    with pytest.raises(ConfigError, match=r"warmup_rounds: expected an integer >= 0, got -1"):
        from_dict(PSOverlapConfig, {"warmup_rounds": -1})
    with pytest.raises(ConfigError, match=r"undecided_factor: expected a number >= 1, got 0.5"):
        from_dict(PSOverlapConfig, {"undecided_factor": 0.5})
    with pytest.raises(ConfigError, match=r"copies: expected an integer >= 1, got 0"):
        from_dict(PSOverlapConfig, {"copies": 0})
    with pytest.raises(ConfigError, match=r"chunk_s: expected a number of seconds >= 0, got -1"):
        from_dict(PSOverlapConfig, {"chunk_s": -1})
    with pytest.raises(ConfigError, match=r"threads: expected an integer >= 1, got 0"):
        from_dict(PSOverlapConfig, {"threads": 0})


def test_ps_overlap_chunk_steps_last_chunk_s_within_bounds() -> None:
    from distopt.bench.ps_overlap import MAX_CHUNK_STEPS, PSOverlapConfig, _chunk_steps

    bench = PSOverlapConfig(steps=30, warmup=3, chunk_s=0.5)
    warm = [0.5] * 3 + [0.004] * 27  # the warm-up steps are not what a chunk's steps take
    assert _chunk_steps(bench, warm) == 3 + 125  # 0.5 s of 4 ms steps after the warm-up
    assert _chunk_steps(bench, [0.1] * 30) == 30  # long steps: never fewer than `steps`
    assert _chunk_steps(bench, [1e-6] * 30) == MAX_CHUNK_STEPS
    assert _chunk_steps(bench, []) == 30  # nothing timed: `steps`
    assert _chunk_steps(PSOverlapConfig(steps=30, warmup=3), warm) == 30  # chunk_s 0: off


@pytest.mark.slow
def test_fsdp_partition_runs_every_variant_quietly(tmp_path, capfd) -> None:
    """Every variant, and stderr (the spawned ranks' included) quiet: the size-based policy's
    FSDP2 units return nn.Linear views, which drew a "returned a view tensor" warning per rank."""
    config = tmp_path / "fsdp.yaml"
    config.write_text(
        "kind: fsdp_partition\nvocab_size: 128\ndim: 32\nheads: 2\nlayers: 3\nseq_len: 8\n"
        f"steps: 1\nwarmup: 0\nrounds: 1\nsize_min_params: 5000\ncache_dir: {tmp_path / 'cache'}\n"
    )
    out = tmp_path / "out.json"
    main(["bench", str(config), "--json", str(out)])
    result = json.loads(out.read_text())
    rows = result["variants"]
    assert set(rows) == {"no_inner_units", "size_based", "per_block", "distopt"}
    assert rows["no_inner_units"]["units"] == 0 and rows["per_block"]["units"] == 3
    assert rows["distopt"]["units"] >= 1
    assert all(r["step_s"] > 0 and r["peak_bytes"] > 0 for r in rows.values())
    assert set(result["ratios"]) >= {"step time vs per-block", "peak RSS vs no inner units"}
    assert noise(capfd.readouterr().err) == []


def test_cnn_fusion_runs_and_reports_setup_time(tmp_path) -> None:
    config = tmp_path / "cnn.yaml"
    config.write_text(
        "kind: cnn_fusion\nwidth: 4\nblocks: [1, 1, 1, 1]\nimage_size: 32\nbatch_size: 2\n"
        "num_classes: 10\nrounds: 1\nwarmup: 0\ncompile: false\n"
    )
    out = tmp_path / "out.json"
    main(["bench", str(config), "--json", str(out)])
    result = json.loads(out.read_text())
    default = "distopt (default passes)"
    assert {"eager", "fx fuse", "distopt (fold + channels-last)", default} <= set(result["eval_s"])
    assert all(t > 0 for t in result["eval_s"].values())
    # The target is scored on what distopt.optimize gives by default.
    assert result["eval_speedup_vs_eager"] == result["eval_s"]["eager"] / result["eval_s"][default]
    assert len(result["train_s"]) == 2 and result["setup_s"]


def test_unknown_kind_is_a_one_line_error(tmp_path, capsys) -> None:
    config = tmp_path / "x.yaml"
    config.write_text("kind: nope\n")
    assert main(["bench", str(config)]) == 2
    assert "kind: unknown benchmark 'nope'" in capsys.readouterr().err


@pytest.mark.slow
def test_remote_idioms_runs(tmp_path) -> None:
    config = tmp_path / "remote_idioms.yaml"
    config.write_text(
        "kind: remote_idioms\nidioms: [tests.remote.corpus.rref_helper]\n"
        "reads: [tests.remote.corpus.tables:lookup_rows]\nlatency_ms: 0.0\n"
        "rounds: 1\nsteps: 3\nwarmup: 1\nbatch_size: 8\n"
        "target_hidden: -1000.0\ntarget_ratio_vs_hand: 0.0\ntarget_prediction_error: 1000.0\n"
        "prediction_steps: 3\n"  # one round on a loaded CI host is noise: the targets are the bench's
    )
    out = tmp_path / "out.json"
    result = subprocess.run(
        [sys.executable, "-m", "distopt", "bench", str(config), "--json", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    data = json.loads(out.read_text())
    (row,) = data["results"]
    assert row["idiom"] == "rref_helper" and set(row["median_step_s"]) == {
        "baseline",
        "optimized",
        "hand",
    }
    assert row["opt_vs_hand_qps"] > 0
    # The cost model's step of both models (rehearsed with dist_autograd), scored beside the
    # measured speed-up.
    prediction = row["prediction"]
    assert prediction["baseline_s"] > 0 and prediction["optimized_s"] > 0
    assert prediction["predicted_gain"] == pytest.approx(
        prediction["baseline_s"] / prediction["optimized_s"]
    )
    measured = row["median_step_s"]["baseline"] / row["median_step_s"]["optimized"]
    assert prediction["error"] == pytest.approx(prediction["predicted_gain"] / measured - 1)
    # Only torch's own deprecation of DistributedOptimizer's TorchScript path (see
    # distopt.bench.remote_idioms): no pipe errors, no RRef leaks at shutdown.
    torchscript = (
        "`TorchScript` support for functional optimizers",
        "optim = _ScriptLocalOptimizer(",
    )
    assert [ln for ln in noise(result.stderr) if not any(t in ln for t in torchscript)] == []
    assert "RRef" not in result.stderr and "pipe closed" not in result.stderr


JOBS = Path(__file__).resolve().parents[2] / "configs" / "jobs"


@pytest.mark.slow
def test_data_loading_runs_both_arms(tmp_path) -> None:
    config = tmp_path / "data.yaml"
    config.write_text(
        f"kind: data_loading\njob: {JOBS / 'dlrm_criteo.yaml'}\nsamples: 2000\nnum_workers: 2\n"
        f"rounds: 2\nsteps: 6\nwarmup: 2\ntarget_ratio: 0.01\noutput_dir: {tmp_path / 'runs'}\n"
    )
    out = tmp_path / "out.json"
    assert main(["bench", str(config), "--json", str(out)]) == 0  # the smoke target is trivial
    result = json.loads(out.read_text())
    assert set(result["arms"]) == {"loader", "prebuilt"} and result["num_workers"] == 2
    assert all(arm["steps"] == 2 * 4 and arm["median_qps"] > 0 for arm in result["arms"].values())
    assert result["ratio"] == pytest.approx(
        result["arms"]["loader"]["median_qps"] / result["arms"]["prebuilt"]["median_qps"]
    )
    assert len(result["load_average_after"]) == 3
    # The cost model predicts the arms alike (its data phase is 0); the loader's measured
    # data phase is what the prediction leaves out.
    assert result["predicted_ratio"] == 1.0
    assert result["prediction_error"] == pytest.approx(1.0 / result["ratio"] - 1)
    assert all(arm["median_data_s"] >= 0 for arm in result["arms"].values())


@pytest.mark.slow
def test_ps_overlap_cached_variants_report_consistent_counts(tmp_path) -> None:
    """The cached variants on Zipf ids: the hit rate is a share, the rows the servers counted
    are the rows the trainer counted, and the exact cache changes no output."""
    config = tmp_path / "ps.yaml"
    config.write_text(
        "kind: ps_overlap\ntables: [2]\nlatency_ms: [0.0]\ncompute: [light]\nrounds: 2\nsteps: 6\n"
        "warmup: 1\nnum_rows: 2000\nembedding_dim: 8\nid_alpha: 1.05\ncache_fraction: 0.05\n"
        "variants: [optimized, pipelined, cached, pipelined+cached]\npipeline_staleness: 1\n"
        "cache_warmup_steps: 5\n"
        f"batching_fetches: 0\noutput_dir: {tmp_path / 'runs'}\n"
    )
    out = tmp_path / "out.json"
    main(["bench", str(config), "--json", str(out)])
    point = json.loads(out.read_text())["points"][0]
    # Fresh batches every round: 5 warm-up steps of the cached variants, then 2 rounds × 6
    # steps of every variant; the static optimum is over all of them.
    assert point["distinct_batches"] == 5 + 12
    cache = point["cache"]
    assert cache["rows"] == 100 and cache["reference"] == "optimized"
    assert cache["warmup_steps"] == 5
    assert 0 < cache["static_optimal_hit_rate"] < 1
    # Every step fetches 2 tables × 64 × 4 ids; uncached, the servers send each of them.
    assert cache["reference_server_rows_per_step"] == 2 * 64 * 4
    assert point["variants"]["pipelined"]["server_rows_per_step"] == 2 * 64 * 4
    for name in ("cached", "pipelined+cached"):
        v = cache["variants"][name]
        assert v["steps"] == 5 + 12
        assert 0 < v["hit_rate"] < 1 and 0 < v["rounds_hit_rate"] < 1
        assert v["hit_vs_static_optimal"] == pytest.approx(
            v["hit_rate"] / cache["static_optimal_hit_rate"]
        )
        assert v["server_rows_per_step"] == v["trainer_rows_per_step"]
        assert v["server_rows_per_step"] == point["variants"][name]["server_rows_per_step"]
        assert v["rows_vs_reference"] == v["server_rows_per_step"] / (2 * 64 * 4)
        # Deduplicated ids: the servers send at most the misses.
        assert v["rows_vs_reference"] <= 1 - v["hit_rate"] + 1e-9
        assert v["cache_bytes"] > 0
        check = v["exact_check"]
        assert check["equal"] and check["hits"] > 0 and check["lookups"] == 4 * 2 * 64 * 4
