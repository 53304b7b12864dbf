"""distopt.torchx.watch: the error line of a failed replica's log is its cause, not a launcher's note."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.utils.data

from distopt.torchx.watch import _last_error_line, _recorded_error
from distopt.training.logs import record_failure
from tests.conftest import free_port

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


class _Events(torch.utils.data.Dataset[int]):
    def __len__(self) -> int:
        return 8

    def __getitem__(self, index: int) -> int:
        if index == 3:
            raise ValueError("row 3 has a malformed 'ts' field")
        return index


def _recorded(err: BaseException, path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    """What ``distopt launch`` reports of ``err``, recorded as a failed trainer records it."""
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(path))
    record_failure(err)
    return _recorded_error(path)


def test_a_dataloader_workers_error_is_reported_by_its_cause(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A user's trial: the report said only `Caught ValueError in DataLoader worker process 0.`"""
    loader = torch.utils.data.DataLoader(_Events(), batch_size=4, num_workers=1)
    with pytest.raises(ValueError) as info:
        list(loader)
    error, cause = _recorded(info.value, tmp_path / "error.json", monkeypatch)
    assert cause == "ValueError: row 3 has a malformed 'ts' field"
    assert error == f"{cause} (ValueError: Caught ValueError in DataLoader worker process 0)"


SERVER_ERROR = """
import sys
import torch.distributed.rpc as rpc
from distopt.training.logs import record_failure

def item_meta(ids):
    raise LookupError("catalog: shard for items 9..796 is unavailable")

rpc.init_rpc("ps0", rank=0, world_size=1, rpc_backend_options=rpc.TensorPipeRpcBackendOptions(
    init_method=f"tcp://127.0.0.1:{sys.argv[1]}", _transports=["uv"]))
try:
    rpc.rpc_sync("ps0", item_meta, args=([9],))
except Exception as err:
    record_failure(err)
rpc.shutdown()
"""


def test_a_remote_calls_error_is_reported_with_the_servers_message(tmp_path: Path) -> None:
    """A user's trial: the report stopped at `LookupError: On WorkerInfo(id=2, name=ps0):`."""
    path = tmp_path / "error.json"
    subprocess.run(
        [sys.executable, "-c", SERVER_ERROR, str(free_port())],
        env={**os.environ, "TORCHELASTIC_ERROR_FILE": str(path)},
        check=True,
        timeout=120,
    )
    error, cause = _recorded_error(path)
    assert cause == "LookupError: catalog: shard for items 9..796 is unavailable"
    assert error == f"RuntimeError: LookupError: On WorkerInfo(id=0, name=ps0): {cause}"
