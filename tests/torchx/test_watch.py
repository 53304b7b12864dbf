"""distopt.torchx.watch: the error line of a failed replica's log is its cause, not a launcher's note."""

from __future__ import annotations

from distopt.torchx.watch import _last_error_line

CAUSE = "distopt.train: error: node0: GLOO_SOCKET_IFNAME (--iface): 'lo' is loopback, ..."


def test_torchrun_and_slurm_notes_after_the_error_are_not_taken_for_it() -> None:
    log = [
        "[W1125 16:13:13.246821943 socket.cpp:207] [c10d] a warning",
        CAUSE,
        "Traceback (most recent call last):",
        "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: ",
        "  traceback : Traceback (most recent call last):",
        "slurmstepd-node0: error: *** STEP 7.0 ON node0 CANCELLED AT 2026-11-25T16:13:23 ***",
    ]
    assert _last_error_line(log) == CAUSE


def test_a_python_error_is_still_the_last_error_line() -> None:
    assert _last_error_line(["x", "ValueError: bad value 3", "done"]) == "ValueError: bad value 3"
