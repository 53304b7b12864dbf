"""The entrypoint of a distopt Ray job: runs every replica of every role as a Ray actor.

:mod:`distopt.torchx.ray_scheduler` submits ``python -m ray_job_driver '<replicas as JSON>'`` as
one Ray job and ships this package with it (``runtime_env.py_modules``), so it imports Ray and the
standard library only: the cluster needs neither distopt nor TorchX.

1. One placement group holds a bundle per replica (CPU, GPU, memory), so the job starts whole or
   not at all: a parameter server never waits for trainers that cannot be placed.
2. One actor per replica, pinned to its bundle. The host of the first replica is the rank-0 host
   (``TORCHX_RANK0_HOST``, TorchX's ``macros.rank0_env``) of every replica.
3. Each actor runs the replica's command in its own process group and streams its output lines
   back (a streaming generator); the driver prints them as ``[role/replica] line``, so the job log
   is exactly what the replicas wrote, in order, with nothing lost when the job ends. (Ray's own
   worker-log forwarding is asynchronous and loses the last lines of a driver that exits.)
4. The job fails as soon as one replica exits non-zero: the others are stopped. ``ray job stop``
   (TorchX ``cancel``) sends SIGTERM here, and the replicas' process groups are stopped before Ray's
   grace period (3 s) ends and it kills this driver, whose actors then die with it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import ray
from ray.util.placement_group import placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

RANK0_ENV = "TORCHX_RANK0_HOST"
PLACEMENT_TIMEOUT_S = float(os.environ.get("DISTOPT_RAY_PLACEMENT_TIMEOUT_S", "300"))
STOP_GRACE_S = 2.0  # within Ray's RAY_JOB_STOP_WAIT_TIME_S (3 s) before it kills this driver


# max_concurrency=2: run() streams for the replica's lifetime, and stop() must still get through.
@ray.remote(max_concurrency=2)  # type: ignore[call-overload]  # Ray's stubs omit actor options
class Replica:
    def __init__(self, name: str, command: list[str], env: dict[str, str]) -> None:
        self.name, self.command, self.env = name, command, env
        self.proc: subprocess.Popen[str] | None = None
        self.stopped = threading.Event()

    def __repr__(self) -> str:  # names the replica in Ray's errors and log prefixes
        return f"Replica({self.name})"

    def host(self) -> str:
        return ray.util.get_node_ip_address()

    def run(self, rank0_host: str) -> Iterator[str | int]:
        """Yields the replica's output lines, then its exit code."""
        if self.stopped.is_set():
            yield -signal.SIGTERM
            return
        # RAY_ADDRESS: a replica that joins Ray (ps.ray_address: auto) joins the cluster it runs
        # on; without it Ray's "auto" takes the cluster started last on that machine.
        cluster = {"RAY_ADDRESS": ray.get_runtime_context().gcs_address}
        env = {**os.environ, **cluster, **self.env, RANK0_ENV: rank0_host}
        # Its own process group: stop() reaches the command's children too (bash -c "a; b").
        self.proc = subprocess.Popen(
            self.command,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            errors="replace",
            bufsize=1,
            preexec_fn=os.setpgrp,
        )
        assert self.proc.stdout is not None
        # Not `yield from`: Ray drives this generator with send(), which a file lacks.
        for line in self.proc.stdout:  # noqa: UP028
            yield line
        yield self.proc.wait()

    def stop(self) -> None:
        self.stopped.set()
        proc = self.proc
        if proc is None or proc.poll() is not None:
            return
        for sig, wait_s in ((signal.SIGTERM, STOP_GRACE_S), (signal.SIGKILL, 1.0)):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                return
            try:
                proc.wait(wait_s)
                return
            except subprocess.TimeoutExpired:
                pass


def _place(replicas: list[dict[str, Any]]) -> Any:
    group = placement_group([r["resources"] for r in replicas], strategy="SPREAD")
    try:
        ray.get(group.ready(), timeout=PLACEMENT_TIMEOUT_S)
    except ray.exceptions.GetTimeoutError:
        wanted = [r["resources"] for r in replicas]
        sys.exit(
            f"[driver] replicas not placed after {PLACEMENT_TIMEOUT_S:.0f}s: they need {wanted}, "
            f"the cluster has {ray.available_resources()} available"
        )
    return group


def _ray_options(resources: dict[str, float], group: Any, index: int) -> dict[str, Any]:
    return {
        "num_cpus": resources.get("CPU", 0),
        "num_gpus": resources.get("GPU", 0),
        "memory": resources.get("memory", 0) or None,
        "scheduling_strategy": PlacementGroupSchedulingStrategy(
            group, placement_group_bundle_index=index
        ),
    }


def main(argv: list[str]) -> int:
    replicas: list[dict[str, Any]] = json.loads(argv[0])
    # log_to_driver=False: the replicas' output comes through run()'s stream, once.
    ray.init(log_to_driver=False)
    group = _place(replicas)
    names = [f"{r['role']}/{r['replica_id']}" for r in replicas]
    actors = [
        Replica.options(**_ray_options(r["resources"], group, i)).remote(  # type: ignore[attr-defined]
            name, r["command"], r["env"]
        )
        for i, (r, name) in enumerate(zip(replicas, names, strict=True))
    ]
    rank0_host = ray.get(actors[0].host.remote())
    codes: dict[str, int] = {}
    failed = threading.Event()
    print_lock = threading.Lock()

    def stop_all() -> None:
        ray.get([a.stop.remote() for a in actors], timeout=STOP_GRACE_S + 2)

    def follow(actor: Any, name: str) -> None:
        code: int = 1
        try:
            for ref in actor.run.remote(rank0_host):
                item = ray.get(ref)
                if isinstance(item, int):
                    code = item
                else:
                    with print_lock:
                        sys.stdout.write(f"[{name}] {item}")
                        sys.stdout.flush()
        except ray.exceptions.RayError as err:
            print(f"[driver] {name} lost: {err}", flush=True)
        codes[name] = code
        if code != 0:
            failed.set()

    def on_sigterm(signum: int, frame: object) -> None:
        print("[driver] stop requested: stopping every replica", flush=True)
        stop_all()
        sys.exit(128 + signum)

    signal.signal(signal.SIGTERM, on_sigterm)
    threads = [
        threading.Thread(target=follow, args=(a, n), daemon=True)
        for a, n in zip(actors, names, strict=True)
    ]
    for thread in threads:
        thread.start()
    # Timed waits keep the main thread responsive to SIGTERM.
    while any(t.is_alive() for t in threads) and not failed.is_set():
        time.sleep(0.2)
    if failed.is_set():
        bad = ", ".join(f"{n} exited with {c}" for n, c in codes.items() if c != 0)
        print(f"[driver] {bad}: stopping the other replicas", flush=True)
        stop_all()
        return 1
    print(f"[driver] all {len(names)} replicas succeeded", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
