"""A server actor SIGKILLed mid-training on a real loopback Ray: the wait fails naming the table
and the actor, Ray restarts the actor, which reloads the last checkpoint, and the training loop
rolls back to that checkpoint and ends bitwise where an uninterrupted run ends."""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import distopt.ps as ps
from distopt.errors import RemoteCallError
from distopt.models.dlrm import DLRM, DLRMConfig, dlrm_loss, dlrm_tables, make_batch
from distopt.ps.server.table import initial_rows
from distopt.ps.spec import ServerOptions
from tests.pipeline.conftest import bitwise_equal

pytest.importorskip("ray")

pytestmark = pytest.mark.slow

CONFIG = DLRMConfig(
    num_tables=2,
    num_rows=40,
    embedding_dim=4,
    batch_size=8,
    bag_size=2,
    bottom_mlp=(8,),
    top_mlp=(8,),
    optimizer="adagrad",
    seed=3,
)
TABLES = dlrm_tables(CONFIG)
STEPS, CHECKPOINT_AT, KILL_AT = 8, 3, 5
LR = 0.05


def _options(**kwargs: Any) -> ServerOptions:
    defaults = {
        "backend": "ray",
        "num_servers": 2,
        "seed": 7,
        "rpc_timeout_s": 10.0,
        "start_timeout_s": 60.0,
    }
    return ServerOptions(**{**defaults, **kwargs})


class Trainer:
    """DLRM with its dense Adagrad; batches depend only on the step, so a run is deterministic."""

    def __init__(self) -> None:
        self.model = DLRM(CONFIG)
        self.opt = torch.optim.Adagrad(self.model.parameters(), lr=LR)

    def step(self, step: int) -> None:
        batch = make_batch(CONFIG, step)
        self.opt.zero_grad()
        dlrm_loss(self.model(batch.dense, batch.sparse), batch.labels).backward()
        ps.push_gradients(lr=LR)  # asynchronous: the next step's fetches are ordered after it
        self.opt.step()

    def save(self, directory: Path, step: int) -> None:
        """The loop's checkpoint: the dense state and the step, then the servers' files (last: the
        job's record then names only checkpoints whose dense state is written)."""
        state = {"model": self.model.state_dict(), "opt": self.opt.state_dict(), "step": step}
        torch.save(state, directory / "dense.pt")
        ps.save_servers(str(directory))

    def load(self, directory: Path) -> int:
        state = torch.load(directory / "dense.pt", weights_only=True)
        self.model.load_state_dict(state["model"])
        self.opt.load_state_dict(state["opt"])
        return int(state["step"])

    def result(self) -> dict[str, Any]:
        return {
            "tables": ps.state_dict(),
            "dense": self.model.state_dict(),
            "opt": self.opt.state_dict(),
        }


def _kill_soon(pid: int, delay_s: float) -> list[float]:
    """SIGKILL ``pid`` after ``delay_s`` from a thread; the list gets the kill's monotonic time."""
    killed: list[float] = []

    def kill() -> None:
        time.sleep(delay_s)
        killed.append(time.monotonic())
        os.kill(pid, signal.SIGKILL)

    threading.Thread(target=kill, daemon=True).start()
    return killed


def test_killed_actor_restarts_from_the_checkpoint_and_the_run_ends_as_an_uninterrupted_one(
    ray_cluster, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    options = _options(max_restarts=1)
    with ps.local_job(TABLES, options):
        reference = Trainer()
        for step in range(STEPS):
            reference.step(step)
        expected = reference.result()

    checkpoint = tmp_path / f"step-{CHECKPOINT_AT}"
    checkpoint.mkdir()
    caplog.set_level(logging.WARNING, logger="distopt.ps.cluster.ray_recovery")
    with ps.local_job(TABLES, options):
        trainer, step, failures = Trainer(), 0, []
        while step < STEPS:
            if step == CHECKPOINT_AT and not checkpoint.joinpath("ps0.pt").exists():
                trainer.save(checkpoint, step)
            killed: list[float] = []
            if step == KILL_AT and not failures:
                ps.set_latency_ms(400)  # the step's first fetch is on the servers when ps1 dies
                killed = _kill_soon(ps.server_stats("ps1")["pid"], 0.1)
            try:
                trainer.step(step)
            except RemoteCallError as err:
                failures.append((err, time.monotonic() - killed[0]))
                assert ps.servers_ready(timeout_s=60.0)  # Ray restarted ps1 ...
                restarted = ps.state_dict()["ps1"]  # ... and it reloaded its shards
                saved = torch.load(checkpoint / "ps1.pt", weights_only=True)["tables"]
                assert bitwise_equal(restarted, saved)
                with pytest.raises(
                    RemoteCallError,
                    match=r"^fetch of 'emb1' on ps1 failed: ServerRestarted: ps1 "
                    r"was restarted by Ray \(pid \d+\) and reloaded its shards from ",
                ):
                    ps.fetch("emb1", [1])  # it answers no data call until the job recovers
                recovery = ps.recover()
                assert recovery == ps.Recovery(checkpoint=str(checkpoint), restarted=("ps1",))
                ps.set_latency_ms(0)
                step = trainer.load(checkpoint)
                continue
            step += 1
        result = trainer.result()

    ((error, seconds),) = failures
    assert str(error).startswith(
        "fetch of 'emb0' on ps1 failed: the actor "
    )  # the table and the actor
    assert "\n" not in str(error) and seconds < options.rpc_timeout_s
    assert bitwise_equal(result, expected)
    notes = [r.getMessage() for r in caplog.records]
    assert any(
        "ps1 was restarted by Ray" in n and f"reloaded its shards from {checkpoint}" in n
        for n in notes
    )
    assert f"distopt.ps: recovered ps1: every server reloaded from {checkpoint}" in notes


def test_without_restarts_a_killed_actor_keeps_failing_with_one_line(ray_cluster) -> None:
    options = _options(max_restarts=0, latency_ms=300, rpc_timeout_s=5.0)
    with ps.local_job(TABLES, options), torch.no_grad():
        fut = ps.fetch_async("emb0", torch.arange(CONFIG.num_rows))
        killed = _kill_soon(ps.server_stats("ps1")["pid"], 0.1)
        with pytest.raises(
            RemoteCallError, match=r"^fetch of 'emb0' on ps1 failed: the actor process exited"
        ):
            ps.wait(fut)
        assert time.monotonic() - killed[0] < options.rpc_timeout_s
        for _ in range(2):
            with pytest.raises(RemoteCallError) as later:
                ps.fetch("emb1", [1, 2])
            assert str(later.value).startswith(
                "fetch of 'emb1' on ps1 failed: the actor process exited or was killed"
            )
            assert "\n" not in str(later.value)
        assert not ps.servers_ready(timeout_s=1.0)
        with pytest.raises(
            RemoteCallError,
            match=r"^distopt\.ps\.recover: ps1 is gone and Ray does not restart "
            r"it \(ps\.max_restarts=0\): the actor process exited or was killed [^\n]*$",
        ):
            ps.recover()
        ps.shutdown(graceful=False)


def test_a_restart_before_any_checkpoint_starts_from_the_seeded_tables_and_says_so(
    ray_cluster, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="distopt.ps.cluster.ray_recovery")
    with ps.local_job(TABLES, _options(max_restarts=1)):
        trainer = Trainer()
        for step in range(2):
            trainer.step(step)
        ps.flush()
        os.kill(ps.server_stats("ps0")["pid"], signal.SIGKILL)  # nothing in flight
        assert ps.servers_ready(timeout_s=60.0)
        with pytest.raises(
            RemoteCallError,
            match=r"^fetch of 'emb0' on ps0 failed: ServerRestarted: ps0 was "
            r"restarted by Ray \(pid \d+\); no checkpoint saved by this job yet: it starts from "
            r"the seeded initial tables; call distopt\.ps\.recover\(\)",
        ):
            ps.fetch("emb0", [0])  # a restart with nothing in flight still shows at the next call
        assert ps.recover() == ps.Recovery(checkpoint=None, restarted=("ps0",))
        with torch.no_grad():
            for spec in TABLES:  # every server back at step 0, not only the restarted one
                assert torch.equal(ps.fetch(spec.name), initial_rows(spec, 7))
        trainer.step(0)  # and the job goes on
    notes = [r.getMessage() for r in caplog.records]
    assert any(
        "ps0 was restarted by Ray" in n and "no checkpoint saved by this job yet" in n
        for n in notes
    )
    assert (
        "distopt.ps: recovered ps0: every server reloaded from the seeded initial tables "
        "(no checkpoint saved)"
    ) in notes


def test_a_save_that_fails_halfway_never_becomes_the_checkpoint_to_reload(
    ray_cluster, tmp_path: Path
) -> None:
    first, second = tmp_path / "first", tmp_path / "second"
    first.mkdir()
    second.mkdir()
    with ps.local_job(TABLES, _options(max_restarts=2)):
        trainer = Trainer()
        trainer.step(0)
        ps.save_servers(str(first))
        at_first = ps.state_dict()
        trainer.step(1)
        ps.flush()
        os.kill(ps.server_stats("ps1")["pid"], signal.SIGKILL)
        with pytest.raises(RemoteCallError, match=r"^checkpoint save on ps1 failed: "):
            ps.save_servers(str(second))  # ps0 wrote its file, ps1 could not
        assert (second / "ps0.pt").exists() and not (second / "ps1.pt").exists()
        assert ps.recover().checkpoint == str(first)
        assert bitwise_equal(ps.state_dict(), at_first)

        trainer.step(1)  # and a failed save over the recorded checkpoint itself: ps0.pt is new,
        ps.flush()  # ps1.pt old, so no server may reload that directory any more
        os.kill(ps.server_stats("ps1")["pid"], signal.SIGKILL)
        with pytest.raises(RemoteCallError, match=r"^checkpoint save on ps1 failed: "):
            ps.save_servers(str(first))
        assert ps.recover().checkpoint is None
        with torch.no_grad():
            assert all(torch.equal(ps.fetch(spec.name), initial_rows(spec, 7)) for spec in TABLES)
