"""ps_overlap's skewed ids and its shaped link: config errors, the bytes that really cross the
link, and the one-line error where namespaces cannot be made."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from distopt.bench.ps_overlap import PSOverlapConfig
from distopt.config import from_dict
from distopt.errors import ConfigError
from tests.launchers.conftest import require_namespaces

REPO = Path(__file__).resolve().parents[2]
DISTOPT = str(Path(sys.executable).with_name("distopt"))


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"id_alpha": 0}, "id_alpha: expected a Zipf exponent > 0, or null for uniform ids, got 0.0"),
        ({"id_alpha": -1.05}, "id_alpha: expected a Zipf exponent > 0, or null for uniform ids, got -1.05"),
        ({"cache_fraction": 0}, "cache_fraction: expected a fraction of the rows in (0, 1], got 0.0"),
        ({"cache_policy": "fifo"}, "cache_policy: expected one of 'lru', 'lfu', got 'fifo'"),
        ({"cache_staleness": -1}, "cache_staleness: expected an integer >= 0 (0: exact), got -1"),
        (
            {"cache_warmup_steps": 100},
            "cache_warmup_steps: expected 0, or steps > 0 with a cached variant (cached or pipelined+cached) among variants, got 100",
        ),
        ({"cache_warmup_steps": -1, "variants": ["cached"]}, "cache_warmup_steps: expected 0, or steps > 0 with a cached variant (cached or pipelined+cached) among variants, got -1"),
        ({"variants": ["cached", "lru"]}, "variants: expected names among baseline, optimized, hand, pipelined, no_network, cached, pipelined+cached, got ('cached', 'lru')"),
        ({"link": {"rate_mbit": 0}}, "link.rate_mbit: expected a number > 0, got 0.0"),
        ({"link": {"rate_mbit": 10, "burst_kib": 1}}, "link.burst_kib: expected a number >= 2, got 1.0"),
        ({"link": {"rate": 10}}, "link.rate: unknown key (known keys: burst_kib, latency_ms, rate_mbit)"),
        ({"loopback_reference": True}, "loopback_reference: expected false without a link (there is nothing to compare loopback with), got True"),
        (
            {"link": {"rate_mbit": 10}, "ps": {"backend": "ray"}},
            "link: expected no link with ps.backend ray (its actors start where Ray places them), got "
            "{'rate_mbit': 10.0, 'burst_kib': None, 'latency_ms': 50.0}",
        ),
    ],
)  # fmt: skip
def test_bad_skew_and_link_settings_are_one_line(config: dict, message: str) -> None:
    with pytest.raises(ConfigError) as err:
        from_dict(PSOverlapConfig, config)
    assert str(err.value) == message


def _config(tmp_path: Path, **values: object) -> Path:
    path = tmp_path / "link.yaml"
    values = {
        "kind": "ps_overlap", "tables": [1], "latency_ms": [0.0], "compute": ["light"],
        "num_rows": 10_000, "embedding_dim": 64, "batch_size": 64, "id_alpha": 1.05,
        "variants": ["optimized", "no_network"], "rounds": 1, "steps": 8, "warmup": 1,
        "batching_fetches": 0, "output_dir": str(tmp_path / "runs"), **values,
    }  # fmt: skip
    path.write_text("".join(f"{k}: {json.dumps(v)}\n" for k, v in values.items()))
    return path


@pytest.mark.slow
@pytest.mark.cluster
def test_rows_cross_the_shaped_link_and_nothing_is_left_behind(tmp_path: Path) -> None:
    require_namespaces()
    config = _config(tmp_path, link={"rate_mbit": 50}, loopback_reference=True)
    out = tmp_path / "out.json"
    bench = subprocess.Popen(
        [DISTOPT, "bench", str(config), "--json", str(out)],
        cwd=tmp_path,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    stdout, stderr = bench.communicate(timeout=300)
    assert bench.returncode == 0 and stderr == "", stdout[-3000:] + stderr[-3000:]
    assert "TensorPipe over TCP (transport uv, channel basic)" in stdout
    report = json.loads(out.read_text())
    # The point on loopback first, then over the link, in one process: the second group forms
    # on the link although the first was on this host.
    loopback, point = report["points"]
    assert (loopback["placement"], loopback["link"], point["placement"]) == (
        "loopback",
        None,
        "link",
    )
    (cost,) = report["link_cost"]
    for name in ("optimized", "no_network"):
        extra = cost["link_step_s"][name] - cost["loopback_step_s"][name]
        assert cost["link_extra_s"][name] == pytest.approx(extra)
    assert "what the link costs" in stdout
    link = point["link"]
    payload = link["payload_bytes_per_step"]
    assert link["rows_per_step"] == 64 * 4 and payload == 64 * 4 * 64 * 4
    for name in ("optimized", "no_network"):
        wire = link["variants"][name]
        # Every fetched row crosses toward the trainer (with the ids, headers and TCP/IP
        # framing on top): what cma would bypass. Toward the servers, a sum-pooled bag's 4
        # gradient rows are equal and cross as one row and a count, with the 4 ids.
        assert payload < wire["from_servers_bytes_per_step"] < 1.5 * payload, wire
        assert payload / 4 < wire["to_servers_bytes_per_step"] < payload / 2, wire
    assert 0 < point["static_optimal_hit_rate"] <= 1 and point["cache_rows"] == 200
    prefix = f"dl{bench.pid % 65536:04x}"
    namespaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert f"{prefix}-ps" not in namespaces
    assert subprocess.run(["ip", "link", "show", f"{prefix}-br"], capture_output=True).returncode


def _running(pid: int) -> bool:
    """Whether ``pid`` is a live process (an exited one not yet reaped is not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


@pytest.mark.slow
@pytest.mark.cluster
# The bench once outlived its signal here: an interrupt landing while a request was being sent
# left that request's future pending, and the flush on the way out waited for it forever
# (distopt.ps.client.futures.after; tests/ps/test_futures.py). A test run started as a
# background job starts the bench with SIGINT ignored, which looked the same.
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_stopped_bench_leaves_nothing_behind(tmp_path: Path, sig: signal.Signals) -> None:
    """Stopped mid-run, as ``timeout`` (SIGTERM to the bench's process group) or Ctrl-C
    (SIGINT) stop it, the bench stops its servers and removes its namespace, the veth pair,
    the bridge and the namespace's /etc/netns files."""
    require_namespaces()
    # Far longer than the test waits: 64 rounds (about 13 s) could end under load before the
    # signal came, which then found the bench removing its link (signals ignored there) and
    # exiting 0.
    config = _config(tmp_path, link={"rate_mbit": 50}, rounds=5000, max_rounds=5000, steps=20)
    # SIGINT as from a terminal: a test run in a background job (`make test &`) has SIGINT
    # ignored, which the bench would inherit; a handler of this process's becomes the default
    # in the bench when it starts.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        bench = subprocess.Popen(
            [DISTOPT, "bench", str(config)],
            cwd=tmp_path,
            env=dict(os.environ, OMP_NUM_THREADS="1"),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,  # its own process group, as under `timeout`
        )
    finally:
        signal.signal(signal.SIGINT, previous)
    prefix = f"dl{bench.pid % 65536:04x}"
    netns = f"{prefix}-ps"
    try:
        assert bench.stdout is not None
        seen = []
        for line in bench.stdout:  # the servers answered a whole round: the run is under way
            seen.append(line)
            if line.startswith("  round 1/"):
                break
        else:
            pytest.fail("".join(seen) + bench.communicate(timeout=60)[1])
        servers = subprocess.run(
            ["ip", "netns", "pids", netns], capture_output=True, text=True, check=True
        ).stdout.split()
        assert servers, f"no process in {netns}"
        if sig == signal.SIGTERM:
            os.killpg(bench.pid, sig)
        else:
            bench.send_signal(sig)
        _, stderr = bench.communicate(timeout=120)
    finally:
        if bench.poll() is None:
            bench.kill()
            bench.wait()
    # SIGTERM ends it as a SystemExit, Ctrl-C as the CLI's one line: no traceback either way.
    assert bench.returncode == 128 + sig, stderr[-3000:]
    assert "Traceback" not in stderr, stderr[-3000:]
    if sig == signal.SIGINT:
        assert stderr.endswith("distopt bench: interrupted\n"), stderr[-3000:]
    assert [pid for pid in servers if _running(int(pid))] == []
    namespaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert netns not in namespaces
    for dev in (netns, f"{prefix}-br"):  # the outer end of the veth pair, the bridge
        assert subprocess.run(["ip", "link", "show", dev], capture_output=True).returncode
    assert not Path("/etc/netns", netns).exists()


def test_a_bench_that_cannot_make_namespaces_fails_in_one_line(tmp_path: Path) -> None:
    setpriv = shutil.which("setpriv")
    if os.geteuid() != 0 or setpriv is None:
        pytest.skip("needs root and setpriv to run the bench as an unprivileged user")
    # A config the unprivileged user can read: the repository's.
    config = str(REPO / "configs/bench/ps_overlap_link.yaml")
    nobody = [setpriv, "--reuid=65534", "--regid=65534", "--clear-groups", "--"]
    done = subprocess.run(
        [*nobody, DISTOPT, "bench", config],
        cwd="/",
        env=dict(os.environ, HOME="/tmp"),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2 and done.stdout == "", done.stdout + done.stderr
    assert done.stderr == (
        "distopt bench: error: link: creating network namespaces needs root (CAP_SYS_ADMIN and "
        "CAP_NET_ADMIN); running as uid 65534\n"
    )
