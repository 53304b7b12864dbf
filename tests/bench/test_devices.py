"""The benchmarks' ``device`` key: on CUDA they run end to end on tiny configs (``make test-gpu``);
without a GPU, ``device: cuda`` is a one-line error before anything starts."""

import json
import time

import pytest
import torch

from distopt.cli import main
from distopt.estimate.ab import default_clock, wall_clock
from tests.noise import noise

TINY = {
    "cnn_fusion": "width: 4\nblocks: [1, 1, 1, 1]\nimage_size: 32\nbatch_size: 2\n"
    "num_classes: 10\nrounds: 1\nwarmup: 0\ncompile: false\n",
    "fsdp_partition": "vocab_size: 128\ndim: 32\nheads: 2\nlayers: 3\nseq_len: 8\nsteps: 1\n"
    "warmup: 0\nrounds: 1\nsize_min_params: 5000\nworld_size: 1\n",
    "ps_overlap": "tables: [2]\nlatency_ms: [2.0]\ncompute: [light]\nrounds: 1\nsteps: 4\n"
    "warmup: 1\nbatching_fetches: 0\n",
    "third_party_fusion": "models: [resnet50]\nimage_size: 64\nbatch_size: 2\nthreads: [0]\n"
    "rounds: 1\ncompile: false\n",
}


def _config(tmp_path, kind: str, device: str) -> str:
    path = tmp_path / f"{kind}.yaml"
    extra = f"output_dir: {tmp_path / 'runs'}\n" if kind == "ps_overlap" else ""
    if kind == "fsdp_partition":
        extra = f"cache_dir: {tmp_path / 'cache'}\n"
    path.write_text(f"kind: {kind}\ndevice: {device}\n{TINY[kind]}{extra}")
    return str(path)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this host has a GPU")
@pytest.mark.parametrize("kind", sorted(TINY))
def test_cuda_without_a_gpu_is_a_one_line_error(tmp_path, capsys, kind) -> None:
    assert main(["bench", _config(tmp_path, kind, "cuda")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "device: 'cuda' requested but" in err[0]


def test_an_unknown_device_names_the_key(tmp_path, capsys) -> None:
    assert main(["bench", _config(tmp_path, "cnn_fusion", "tpu")]) == 2
    assert "device" in capsys.readouterr().err


@pytest.mark.cuda
@pytest.mark.parametrize("kind", sorted(TINY))
def test_benchmark_runs_on_cuda(tmp_path, capfd, kind) -> None:
    if kind == "third_party_fusion":
        pytest.importorskip("transformers")
    out = tmp_path / "out.json"
    torch.cuda.reset_peak_memory_stats()
    main(["bench", _config(tmp_path, kind, "cuda"), "--json", str(out)])
    result = json.loads(out.read_text())
    if kind != "fsdp_partition":  # its ranks are processes of their own
        assert torch.cuda.max_memory_allocated() > 0  # the models ran on the GPU
    if kind == "cnn_fusion":
        assert result["device_name"] == torch.cuda.get_device_name()
        assert all(t > 0 for t in result["eval_s"].values())
    elif kind == "fsdp_partition":
        assert result["device_name"] == torch.cuda.get_device_name()
        assert all(r["step_s"] > 0 and r["peak_bytes"] > 0 for r in result["variants"].values())
    elif kind == "ps_overlap":
        assert result["device_name"] == torch.cuda.get_device_name()
        point = result["points"][0]
        assert all(v["median_step_s"] > 0 for v in point["variants"].values())
    else:
        assert result["rows"][0]["device_name"] == torch.cuda.get_device_name()
    assert noise(capfd.readouterr().err) == []


@pytest.mark.slow
def test_third_party_fusion_runs_on_the_cpu(tmp_path) -> None:
    pytest.importorskip("transformers")
    out = tmp_path / "out.json"
    main(["bench", _config(tmp_path, "third_party_fusion", "cpu"), "--json", str(out)])
    row = json.loads(out.read_text())["rows"][0]
    assert row["device_name"] == "CPU" and row["median_s"]["distopt"] > 0


@pytest.mark.cuda
@pytest.mark.parametrize("clock", [wall_clock, default_clock])
def test_clocks_count_the_gpu_work_of_a_call(clock) -> None:
    """A call that queues GPU work returns at once; distopt's clocks wait for the work."""
    a = torch.randn(4096, 4096, device="cuda")
    torch.cuda.synchronize()

    def queued() -> None:
        for _ in range(20):
            a @ a

    start = time.perf_counter()
    queued()
    launch_s = time.perf_counter() - start
    torch.cuda.synchronize()
    done = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    done[0].record()
    queued()
    done[1].record()
    torch.cuda.synchronize()
    gpu_s = done[0].elapsed_time(done[1]) / 1e3
    assert launch_s < gpu_s  # otherwise the test shows nothing
    assert clock("call", queued) >= 0.9 * gpu_s
