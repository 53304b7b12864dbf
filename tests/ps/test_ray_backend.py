"""The parameter server on Ray actors (``ps.backend: ray``) against a real loopback Ray instance:
the same numerics, ordering, errors and checkpoints as the RPC backend."""

from __future__ import annotations

import copy
import dataclasses
import os
import signal
import time
import warnings
from pathlib import Path

import pytest
import torch

import distopt
import distopt.ps as ps
from distopt.config import from_dict
from distopt.errors import ConfigError, RemoteCallError
from distopt.models.dlrm import DLRM, DLRMConfig, dlrm_tables, make_batch
from distopt.optimize.gain import predict_gain
from distopt.ps.server.table import ShardTable, initial_rows
from distopt.ps.spec import ServerOptions, TableSpec
from distopt.remote.ops import remote_ops
from distopt.remote.wait import is_wait
from distopt.report import report_of

ray = pytest.importorskip("ray")

pytestmark = pytest.mark.slow

SEED = 5
TABLES = (
    TableSpec(name="sgd", num_rows=10, dim=4),
    TableSpec(name="ada", num_rows=12, dim=3, optimizer="adagrad"),
    TableSpec(name="row", num_rows=9, dim=2, optimizer="rowwise_adagrad"),
    TableSpec(name="dense", num_rows=3, dim=5, kind="dense"),
)


def _options(backend: str, **kwargs) -> ServerOptions:
    defaults = {"num_servers": 2, "seed": SEED, "rpc_timeout_s": 10.0, "start_timeout_s": 30.0}
    return ServerOptions(backend=backend, **{**defaults, **kwargs})


def _train(steps: int = 3) -> dict[str, torch.Tensor]:
    """Pushes and fetches of every table from fixed seeds; the tables afterwards. Odd steps push
    every table in one batched request per server, even steps one request per table."""
    gen = torch.Generator().manual_seed(11)
    for step in range(steps):
        pushes = []
        for spec in TABLES:
            ids = torch.randint(0, spec.num_rows, (7,), generator=gen)
            with torch.no_grad():
                ps.fetch(spec.name, ids)
            pushes.append((spec.name, ids, torch.randn(7, spec.dim, generator=gen)))
            if step % 2 == 0:
                ps.push_async(*pushes[-1], lr=0.3)
        if step % 2:
            ps.push_many_async(pushes, lr=0.3)
    with torch.no_grad():
        return {spec.name: ps.fetch(spec.name) for spec in TABLES}


def test_bad_backend_is_a_one_line_error_naming_the_key() -> None:
    with pytest.raises(ConfigError, match=r"^ps\.backend: expected one of rpc, ray, got 'x'$"):
        ServerOptions(backend="x")
    with pytest.raises(ConfigError, match=r"^ps\.backend: expected one of rpc, ray, got 'grpc'$"):
        from_dict(ServerOptions, {"backend": "grpc"}, prefix="ps")


def test_numerics_and_checkpoints_agree_across_backends(ray_cluster, tmp_path: Path) -> None:
    """Same seeds → bitwise-equal tables; a checkpoint of either backend resumes on the other."""
    (tmp_path / "rpc").mkdir()
    (tmp_path / "ray").mkdir()
    with ps.local_job(TABLES, _options("rpc")):
        on_rpc = _train()
        ps.save_servers(str(tmp_path / "rpc"))
    with ps.local_job(TABLES, _options("ray")) as job:
        assert job.ray_namespace is not None and not job.pids
        on_ray = _train()
        assert all(torch.equal(on_rpc[t], on_ray[t]) for t in on_rpc)
        ps.load_servers(str(tmp_path / "rpc"))  # resume the RPC job's checkpoint on actors
        with torch.no_grad():
            assert all(torch.equal(ps.fetch(t), on_rpc[t]) for t in on_rpc)
        resumed = _train(steps=1)
        saved_on_ray = ps.state_dict()
        ps.save_servers(str(tmp_path / "ray"))
    with ps.local_job(TABLES, _options("rpc")):
        ps.load_servers(str(tmp_path / "ray"))  # and back: optimizer state included
        loaded = ps.state_dict()
        with torch.no_grad():
            assert all(torch.equal(ps.fetch(t), resumed[t]) for t in resumed)
    for server, shards in saved_on_ray.items():
        for table, state in shards.items():
            for key, value in state.items():
                other = loaded[server][table][key]
                assert (
                    torch.equal(value, other) if isinstance(value, torch.Tensor) else value == other
                )


def test_interleaved_pushes_and_fetches_equal_the_sequential_reference(ray_cluster) -> None:
    """Nothing waited in between, slow threaded actors: every fetch sees exactly the pushes
    issued before it (the client orders conflicting calls; Ray's execution order does not matter)."""
    spec = TABLES[1]
    reference = ShardTable(spec, shard=0, num_shards=1, seed=SEED)
    gen = torch.Generator().manual_seed(2)
    fetches, expected = [], []
    # 40 ms per answer: the check that the first fetch is still out once three calls were issued
    # must not depend on those calls being issued within the latency on a loaded CI host
    # (at 5 ms it failed there once).
    with ps.local_job(TABLES, _options("ray", latency_ms=40)), torch.no_grad():
        for step in range(12):
            ids = torch.randint(0, spec.num_rows, (5,), generator=gen)
            fetches.append(ps.fetch_async(spec.name, ids))
            fetches.append(ps.fetch_async("sgd", torch.arange(10)))  # another table meanwhile
            expected.append(reference.fetch(ids))
            expected.append(initial_rows(TABLES[0], SEED))
            grads = torch.randn(5, spec.dim, generator=gen)
            ps.push_async(spec.name, ids, grads, lr=0.5)
            reference.push(ids, grads, lr=0.5)
            assert step or not fetches[0].done()  # truly in flight together
        got = [ps.wait(f) for f in fetches]
        final = ps.fetch(spec.name)
    assert all(torch.equal(g, e) for g, e in zip(got, expected, strict=True))
    assert torch.equal(final, reference.weight)


def test_batched_fetch_and_push_are_one_call_per_actor(ray_cluster) -> None:
    with ps.local_job(TABLES, _options("ray")), torch.no_grad():
        before = {s: ps.server_stats(s) for s in ("ps0", "ps1")}
        rows = ps.wait(ps.fetch_many_async([("sgd", [0, 1, 2]), ("ada", [3, 4]), ("row", [8])]))
        assert torch.equal(rows[1], initial_rows(TABLES[1], SEED)[[3, 4]])
        ps.wait(
            ps.push_many_async(
                [
                    ("sgd", torch.tensor([0, 1]), torch.ones(2, 4)),
                    ("ada", torch.tensor([2, 3]), torch.ones(2, 3)),
                ],
                lr=1.0,
            )
        )
        for server in ("ps0", "ps1"):
            after = ps.server_stats(server)
            assert after["requests"] - before[server].get("requests", 0) == 2
            assert after["fetch_many"] - before[server].get("fetch_many", 0) == 1
            assert after["push_many"] - before[server].get("push_many", 0) == 1
        torch.testing.assert_close(
            ps.fetch("sgd", [0, 1]), initial_rows(TABLES[0], SEED)[[0, 1]] - 1
        )


def test_packed_pushes_reach_the_actors_and_update_as_the_rows_sent_whole(ray_cluster) -> None:
    """Gradient rows in runs (pooled bags) cross to the actors packed, one push and a batched
    push: the tables are bitwise those of the same rows pushed one by one."""
    gen = torch.Generator().manual_seed(4)
    pushes = [
        (spec.name, 2 * torch.randint(0, spec.num_rows // 2, (12,), generator=gen), spec)
        for spec in TABLES[:3]  # even ids: all on ps0, so each bag's 4 rows stay one run
    ]
    expected = {
        spec.name: ShardTable(spec, shard=0, num_shards=1, seed=SEED) for _, _, spec in pushes
    }
    with ps.local_job(TABLES, _options("ray")), torch.no_grad():
        for step in range(2):
            batch = []
            for name, ids, spec in pushes:
                grads = torch.randn(3, spec.dim, generator=gen).repeat_interleave(4, dim=0)
                expected[name].push(ids, grads, lr=0.3)
                batch.append((name, ids, grads))
            if step:
                ps.wait(ps.push_many_async(batch, lr=0.3))
            else:
                for item in batch:
                    ps.wait(ps.push_async(*item, lr=0.3))
        pushed = sum(ps.server_stats(s).get("bytes_pushed", 0) for s in ("ps0", "ps1"))
        assert all(torch.equal(ps.fetch(name), expected[name].weight) for name in expected)
    # Per push: 3 rows of each table's dim and 3 counts (int32), not 12 rows.
    assert pushed == 2 * sum(3 * 4 * spec.dim + 3 * 4 for spec in TABLES[:3])


def test_errors_name_the_actor_and_a_killed_actor_fails_within_the_timeout(ray_cluster) -> None:
    options = _options("ray", latency_ms=500, rpc_timeout_s=5.0)
    with ps.local_job(TABLES, options), torch.no_grad():
        with pytest.raises(ConfigError, match=r"unknown table 'nope'"):
            ps.fetch("nope", [0])
        with pytest.raises(
            RemoteCallError,
            match=r"^fetch of 'sgd' on ps1 failed: ConfigError: table 'sgd': row id 99 outside 0\.\.9$",
        ):
            ps.fetch("sgd", [2, 99])
        pid = ps.server_stats("ps1")["pid"]
        fut = ps.fetch_async("sgd", torch.arange(10))  # both shards, 500 ms each
        os.kill(pid, signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(
            RemoteCallError, match=r"fetch of 'sgd' on ps1 failed: the actor process exited"
        ):
            ps.wait(fut)
        assert time.monotonic() - start < options.rpc_timeout_s
        with pytest.raises(RemoteCallError, match="on ps1 failed"):  # later calls fail too
            ps.fetch("sgd", [1])
        ps.shutdown(graceful=False)  # the job is broken: leave without draining


def test_optimize_hoists_and_batches_fetches_on_the_ray_backend(ray_cluster) -> None:
    config = DLRMConfig(num_tables=3, num_rows=50, embedding_dim=8, batch_size=6, bag_size=3)
    options = ServerOptions(num_servers=1, backend="ray", latency_ms=2, start_timeout_s=30)
    batch = make_batch(config, 0)
    with ps.local_job(dlrm_tables(config), options):
        torch.manual_seed(0)
        model = DLRM(config)
        with warnings.catch_warnings():
            warnings.simplefilter("error", distopt.DistoptFallbackWarning)
            gm = distopt.optimize(model, (batch.dense, batch.sparse))
        verification = report_of(gm).verification
        assert verification.passed and verification.skipped is None, verification
        nodes = list(gm.graph.nodes)
        ops = remote_ops(gm.graph)
        issues = [i for i, n in enumerate(nodes) if n in ops and n is ops[n].start]
        waits = [i for i, n in enumerate(nodes) if is_wait(n)]
        towers = [
            i
            for i, n in enumerate(nodes)
            if n.op == "call_module" and str(n.target).startswith("towers")
        ]
        assert len(issues) == 1, gm.code  # the three fetches batched into one request
        assert issues[0] < min(towers) and waits and max(waits) > min(towers), gm.code
        with torch.no_grad():
            torch.testing.assert_close(
                gm(batch.dense, batch.sparse), model(batch.dense, batch.sparse), rtol=0, atol=0
            )


def test_the_cost_model_rehearses_every_schedule_on_the_ray_backend(ray_cluster) -> None:
    """The rehearsal's dry-run pushes and the pipeline's prefetches reach the actors as calls of
    their own (not the model's, which a measuring run refuses to write with), and change nothing."""
    config = DLRMConfig(num_tables=2, num_rows=50, embedding_dim=4, batch_size=6, bag_size=3)
    options = ServerOptions(num_servers=1, backend="ray", latency_ms=2, start_timeout_s=30)
    batch = make_batch(config, 0)
    with ps.local_job(dlrm_tables(config), options):
        torch.manual_seed(0)
        model = DLRM(config)
        gm = distopt.optimize(copy.deepcopy(model), (batch.dense, batch.sparse))
        ps.discard_step()
        with torch.no_grad():
            before = {t: ps.fetch(t) for t in config.table_names}
        prediction = predict_gain(
            model,
            gm,
            (batch.dense, batch.sparse),
            measure_step=True,
            repeats=2,
            pipeline_staleness=2,
            baseline_pushes="blocking",
        )
        with torch.no_grad():
            after = {t: ps.fetch(t) for t in config.table_names}
        stats = ps.server_stats("ps0")
    assert prediction.costs is not None
    assert set(prediction.costs.rehearsed) == {"baseline", "optimized", "pipelined"}
    # The baseline waits for its push (2 ms on the actor); the others only send theirs.
    rehearsed = prediction.costs.rehearsed
    assert rehearsed["baseline"]["pushes"] >= 0.002
    assert rehearsed["baseline"]["pushes"] > rehearsed["optimized"]["pushes"]
    assert stats["push_dry_run"] > 0 and stats.get("push_many", 0) == 0
    # One backward, measured in both models' steps; the pipeline's runs beside its prefetches.
    assert rehearsed["baseline"]["backward"] == rehearsed["optimized"]["backward"]
    assert rehearsed["pipelined"]["backward"] != rehearsed["baseline"]["backward"]
    assert all(torch.equal(before[t], after[t]) for t in before)


def test_a_private_instance_stays_on_loopback_and_runs_actors_at_the_trainers_priority() -> None:
    """``ps.ray_address: local`` with ``ps.host`` 127.0.0.1: the instance's node is 127.0.0.1, not
    the external address Ray would otherwise swap in, and its actors are not reniced below the
    process that started them (Ray's default niceness 15 starves servers on a busy host). A fresh
    process: Ray is one per process."""
    import subprocess
    import sys

    script = (
        "import ray\n"
        "from distopt.ps.cluster.ray_backend import ensure_ray\n"
        "from distopt.ps.spec import ServerOptions\n"
        "ensure_ray('local', ServerOptions(backend='ray'))\n"
        "@ray.remote\n"
        "class Probe:\n"
        "    def niceness(self):\n"
        "        import os\n"
        "        return os.nice(0)\n"
        "try:\n"
        "    import os\n"
        "    print(ray.get(Probe.remote().niceness.remote()) - os.nice(0))\n"
        "    print(sorted({n['NodeManagerAddress'] for n in ray.nodes()}))\n"
        "finally:\n"
        "    ray.shutdown()\n"
    )
    env = dict(os.environ, RAY_AUTH_MODE="disabled")
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env
    )
    assert done.returncode == 0, done.stderr[-2000:]
    *_, niceness, nodes = done.stdout.strip().splitlines()
    assert nodes == "['127.0.0.1']"
    assert niceness == "0"


def test_actors_that_answer_late_name_the_key_to_raise(ray_cluster) -> None:
    """A new user's loaded 2-core host: the actors' processes took longer to start than the
    deadline (then 30 s by default, now 120 s): the error says which key to raise, and how."""
    from distopt.ps.cluster.ray_backend import RayBackend, lookup_actors

    assert ServerOptions().start_timeout_s == 120.0
    backend, options = RayBackend(), _options("ray")
    job, actors = backend.start(
        TABLES, options, plan=backend.stores(options), num_trainers=1, log_dir=None
    )
    try:
        assert job.ray_address is not None and job.ray_namespace is not None
        # Just created: no actor process can answer within a millisecond.
        hurried = dataclasses.replace(options, start_timeout_s=0.001)
        with pytest.raises(RemoteCallError) as err:
            lookup_actors(job.ray_address, job.ray_namespace, hurried)
        assert str(err.value) == (
            "ps.backend=ray: actors ps0, ps1 did not start within 0.001 s (ps.start_timeout_s): "
            "each is a new process that imports torch, slow on a loaded host; raise "
            "ps.start_timeout_s (e.g. --set ps.start_timeout_s=0.002)"
        )
        assert lookup_actors(job.ray_address, job.ray_namespace, options).keys() == {"ps0", "ps1"}
    finally:
        backend.stop(job, actors, timeout_s=10)


def test_ray_resources_place_the_actors_and_a_resource_no_node_has_is_one_line(
    ray_cluster,
) -> None:
    """``ps.ray_resources`` goes into every actor's bundle: Ray's ``node:ADDR`` resource puts the
    actors on that node; a resource the cluster lacks fails within ``ps.start_timeout_s`` in one
    line naming the key, the resource and the nodes there are."""
    from ray.util import placement_group_table

    options = _options("ray", ray_num_cpus=0.25, ray_resources={"node:127.0.0.1": 0.01})
    with ps.local_job(TABLES, options), torch.no_grad():
        assert ps.fetch("sgd", [0, 1]).shape == (2, 4)
        (group,) = [g for g in placement_group_table().values() if g["state"] == "CREATED"]
        assert list(group["bundles"].values()) == [{"CPU": 0.25, "node:127.0.0.1": 0.01}] * 2
    missing = _options("ray", ray_resources={"node:10.9.9.9": 0.01}, start_timeout_s=2.0)
    with pytest.raises(ConfigError) as err:
        with ps.local_job(TABLES, missing):
            pass
    message = str(err.value)
    assert "\n" not in message and message.startswith(
        "ps.ray_resources: the Ray cluster could not place 2 server actors of 1 CPU, "
        "0.01 node:10.9.9.9 each (PACK) within 2 s (ps.start_timeout_s); no node has "
        "node:10.9.9.9 (nodes: node:127.0.0.1); available now: "
    ), message


@pytest.mark.parametrize(
    ("resources", "message"),
    [
        ({"CPU": 1}, "ps.ray_resources.CPU: expected a resource other than CPU, GPU and memory "
                     "(set ps.ray_num_cpus, ps.ray_memory_mb), got 1.0"),
        ({"ps": 0}, "ps.ray_resources.ps: expected a number > 0, got 0.0"),
        ({"ps": "x"}, "ps.ray_resources.ps: expected a number, got 'x'"),
    ],
)  # fmt: skip
def test_bad_ray_resources_are_one_line_errors(resources: dict, message: str) -> None:
    with pytest.raises(ConfigError) as err:
        from_dict(ServerOptions, {"ray_resources": resources}, prefix="ps")
    assert str(err.value) == message
