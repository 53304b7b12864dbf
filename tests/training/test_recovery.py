"""The pieces of an in-process recovery (distopt.training.recovery): which errors mean a lost server
actor, the trainers' agreement to roll back, and a QPS log continued after a rollback."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from distopt.dist.rendezvous import StorePlan, init_gloo, spawned_gloo
from distopt.errors import RemoteCallError
from distopt.metrics.qps_log import QpsLogWriter, load_run
from distopt.ps.spec import ServerOptions
from distopt.training import state as job_state
from distopt.training.checkpoint import latest_complete
from distopt.training.recovery import Agreement, Rollback, lost_server, retrying
from distopt.training.telemetry import kept_before, reopen_log

DIED = "fetch of 'emb0' on ps1 failed: the actor process exited or was killed (Ray: ActorDiedError)"


@pytest.mark.parametrize(
    ("message", "server"),
    [
        (DIED, "ps1"),
        (
            "push to 'emb2' on ps0 failed: the actor is unreachable or restarting; the call may or may not "
            "have run (Ray: ActorUnavailableError)",
            "ps0",
        ),  # fmt: skip
        (
            "fetch of 'emb1' on ps12 failed: ServerRestarted: ps12 was restarted by Ray (pid 42) and reloaded "
            "its shards from /c/step-4; call distopt.ps.recover() to reload every server",
            "ps12",
        ),  # fmt: skip
        (
            f"ps.fetch:emb0: an earlier push to the table failed: {DIED}",
            "ps1",
        ),  # quoted by a later call
        (
            "fetch of 'emb0' on ps1 failed: no answer within 30 s (ps.rpc_timeout_s): the server is slow, "
            "stuck or gone",
            None,
        ),  # fmt: skip
        ("fetch of 'emb0' on ps1 failed: KeyError: ps1 holds no table 'emb0'", None),
        (
            "distopt.ps.recover: ps1 is gone and Ray does not restart it (ps.max_restarts=0): "
            "the actor process exited or was killed (Ray: ActorDiedError)",
            None,
        ),  # fmt: skip
    ],
)
def test_lost_server_names_the_actor_only_for_a_death_or_restart(
    message: str, server: str | None
) -> None:
    assert lost_server(RemoteCallError(message)) == server


def test_only_remote_call_errors_are_lost_servers() -> None:
    assert lost_server(RuntimeError(DIED)) is None


def test_a_disabled_agreement_lets_every_error_through() -> None:
    agreement = Agreement.for_job(ServerOptions(backend="ray", max_restarts=0))
    assert not agreement.enabled
    with pytest.raises(RemoteCallError, match="^fetch of 'emb0' on ps1 failed"), agreement.agreed():
        raise RemoteCallError(DIED)
    assert not Agreement.for_job(ServerOptions(backend="rpc", max_restarts=2)).enabled


def test_a_lone_trainer_rolls_back_at_the_agreement_point() -> None:
    agreement = Agreement.for_job(ServerOptions(backend="ray", max_restarts=-1))
    assert agreement.enabled and agreement.limit == 100
    agreement.step = 7
    with pytest.raises(Rollback) as raised, agreement.agreed():
        raise RemoteCallError(DIED)
    assert str(raised.value) == f"ps1 lost at step 7 (trainer 0: {DIED})"
    with pytest.raises(ValueError), agreement.agreed():
        raise ValueError("not a lost server")  # at once, not deferred
    with agreement.agreed():
        pass  # nothing deferred: no rollback


def test_retrying_runs_again_up_to_the_limit_then_fails_in_one_line() -> None:
    agreement = Agreement(enabled=True, limit=1)
    calls: list[int] = []

    def run() -> int:
        calls.append(len(calls))
        if agreement.rollback is not None:  # re-entered: what recover_servers records
            agreement.history.append({})
            agreement.rollback = None
        raise Rollback(step=3, reasons=(None, DIED))

    with pytest.raises(RemoteCallError) as raised:
        retrying(run, agreement)
    assert calls == [0, 1]
    assert str(raised.value) == (f"ps1 lost at step 3 (trainer 1: {DIED}): no recovery left "
                                 "(1 done, ps.max_restarts=1)")  # fmt: skip


def _agreeing_rank(rank: int, plan: StorePlan, out: str) -> None:
    """Rank 1 loses a server in step 2's forward; rank 0 saw nothing and would go on to backward."""
    init_gloo(plan, me=f"rank{rank}", rank=rank, world_size=2, timeout_s=60.0)
    agreement = Agreement(enabled=True, limit=1)
    seen = []
    try:
        for step in range(4):
            agreement.step = step
            try:
                with agreement.agreed():
                    if rank == 1 and step == 2:
                        raise RemoteCallError(DIED)
            except Rollback as rollback:
                seen.append((step, rollback.server, rollback.reasons))
                break
            dist.all_reduce(torch.ones(1))  # DDP's gradient all-reduce: only if nobody failed
            seen.append((step, None, None))
        dist.barrier()  # both ranks still in step: the collectives matched
        Path(out, f"rank{rank}.out").write_text(json.dumps(seen))
    finally:
        dist.destroy_process_group()


def _two_trainers(rank_fn: Callable[[int, StorePlan, str], None], out: Path) -> list[str]:
    """What each of two gloo ranks running ``rank_fn`` wrote to ``out/rank<r>.out``."""
    with spawned_gloo() as plan:
        mp.spawn(rank_fn, args=(plan, str(out)), nprocs=2, join=True)
    return [(out / f"rank{rank}.out").read_text() for rank in (0, 1)]


@pytest.mark.slow
def test_two_trainers_roll_back_together_when_one_loses_a_server(tmp_path: Path) -> None:
    expected = [[0, None, None], [1, None, None], [2, "ps1", [None, DIED]]]
    for written in _two_trainers(_agreeing_rank, tmp_path):
        assert json.loads(written) == expected


def _cutting_rank(rank: int, plan: StorePlan, out: str) -> None:
    """Trainer 0's servers fail to save (a restarted actor refuses saves): nobody completes the cut."""
    init_gloo(plan, me=f"rank{rank}", rank=rank, world_size=2, timeout_s=60.0)
    agreement = Agreement(enabled=True, limit=1)
    model = torch.nn.Linear(2, 1)
    saver = job_state.trainer_state(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                    rank=rank, parallel="ddp", num_trainers=2, job={})  # fmt: skip

    def save_remote(path: Path) -> None:
        raise RemoteCallError(
            "checkpoint save on ps0 failed: ServerRestarted: ps0 was restarted by Ray"
        )

    try:
        agreement.step = 3
        try:
            job_state.cut(Path(out) / "ckpt", saver, step=4, save_remote=agreement.deferring(save_remote),
                          check=agreement.settle)  # fmt: skip
        except Rollback as rollback:
            Path(out, f"rank{rank}.out").write_text(str(rollback))
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_a_failed_save_of_the_servers_rolls_back_before_the_checkpoint_is_complete(
    tmp_path: Path,
) -> None:
    for written in _two_trainers(_cutting_rank, tmp_path):
        assert written == (
            "ps0 lost at step 3 (trainer 0: checkpoint save on ps0 failed: ServerRestarted: ps0 was restarted by Ray)"
        )
    assert latest_complete(tmp_path / "ckpt") is None


def test_a_continued_log_drops_the_steps_run_again_and_lists_the_recovery(tmp_path: Path) -> None:
    log = QpsLogWriter.create(tmp_path, run_id="r", variant="v", rank=0, world_size=1, global_batch_size=8,
                              config={})  # fmt: skip
    for step in range(6):
        log.log_step(step, 0.1, loss=float(step))
        if step + 1 in (2, 4):
            log.log_eval(step + 1, {"eval_loss": 0.5}, eval_time_s=0.1)
    log.close(status="failed", error="Rollback: ps0 lost at step 5")
    path = tmp_path / "r" / "qps-rank0.jsonl"
    again = reopen_log(path, before_step=4)  # back to the checkpoint after 4 steps
    assert again.steps_logged == 4
    again.footer["recoveries"] = [{"server": "ps0", "failed_step": 5, "resumed_from": 4}]
    for step in range(4, 6):
        again.log_step(step, 0.2, loss=float(step))
    again.close()
    (rank,) = load_run(tmp_path / "r").ranks.values()
    assert [s.step for s in rank.steps] == list(range(6)) and [e.step for e in rank.evals] == [2, 4]
    assert [s.step_time_s for s in rank.steps] == [0.1] * 4 + [0.2] * 2
    assert rank.footer is not None and rank.footer["status"] == "ok" and rank.footer["steps"] == 6
    assert rank.footer["recoveries"] == [{"server": "ps0", "failed_step": 5, "resumed_from": 4}]


def test_kept_before_keeps_the_header_earlier_steps_and_evaluations_up_to_the_step() -> None:
    records = [{"type": "header"}, {"type": "step", "step": 3}, {"type": "step", "step": 4},
               {"type": "eval", "step": 4}, {"type": "eval", "step": 5}, {"type": "footer"}]  # fmt: skip
    assert [r for r in records if kept_before(r, 4)] == records[:2] + records[3:4]
