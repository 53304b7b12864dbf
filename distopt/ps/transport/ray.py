"""The Ray transport's trainer end (``ps.backend: ray``): calls to the job's server actors.

:class:`RayTransport` sends ``call(server, "fetch", args, ...)`` as ``handle.fetch.remote(*args)``
with the error semantics of the RPC transport. Ray runs an answer's callbacks on its own thread,
where the client's ordering must not start more calls: the callback only queues the answer, and
one reactor thread per transport completes the futures and fails the calls past their deadline.
"""

from __future__ import annotations

import concurrent.futures
import heapq
import itertools
import threading
import time
from collections import deque
from collections.abc import Mapping
from typing import Any

import ray
from torch.futures import Future

from distopt.errors import RemoteCallError
from distopt.ps.server.parameter_server import OPERATIONS
from distopt.ps.transport.base import ACTOR_EXITED, ACTOR_UNAVAILABLE
from distopt.ps.transport.ray_wire import from_wire, to_wire

METHODS: frozenset[str] = frozenset(
    name for name, op in OPERATIONS.items() if "ray" in op.transports
)
"""The operations a server actor answers (its methods of the same names)."""


def ray_message(err: BaseException) -> str:
    """The server-side exception as one line (``KeyError: ps0 holds no table 'x' ...``).

    Ray wraps an actor method's exception in a ``RayTaskError`` whose ``cause`` is the original;
    a dead actor raises ``ActorDiedError`` with a multi-line explanation.
    """
    cause = getattr(err, "cause", None)
    if isinstance(err, ray.exceptions.RayTaskError) and isinstance(cause, BaseException):
        text = (
            cause.args[0] if len(cause.args) == 1 and isinstance(cause.args[0], str) else str(cause)
        )
        first = text.strip().splitlines()[0] if text.strip() else ""
        return f"{type(cause).__name__}: {first}" if first else type(cause).__name__
    if isinstance(err, ray.exceptions.ActorUnavailableError):
        return f"{ACTOR_UNAVAILABLE}; the call may or may not have run (Ray: ActorUnavailableError)"
    if isinstance(err, ray.exceptions.RayActorError):
        return f"{ACTOR_EXITED} (Ray: {type(err).__name__})"
    lines = [ln.strip() for ln in str(err).splitlines() if ln.strip()]
    return f"{type(err).__name__}: {lines[0]}" if lines else type(err).__name__


class RayTransport:
    """Calls to the job's server actors, by server name (``handles``), completed on one thread."""

    def __init__(self, handles: Mapping[str, Any]) -> None:
        self.handles = dict(handles)
        self._cond = threading.Condition()
        self._answers: deque[tuple[int, concurrent.futures.Future[Any]]] = deque()
        self._deadlines: list[tuple[float, int]] = []
        self._pending: dict[int, tuple[Future, str, float]] = {}
        """Call id → (its future, the error prefix naming the operation and actor, its timeout)."""
        self._unanswered: set[int] = set()
        """Calls Ray has not answered yet, including those already failed by their deadline."""
        self._ids = itertools.count()
        self._closed = False
        self._thread = threading.Thread(
            target=self._run, name="distopt-ps-ray-reactor", daemon=True
        )
        self._thread.start()

    def call(
        self, server: str, op: str, args: tuple[Any, ...], *, what: str, timeout_s: float
    ) -> Future:
        """``handle.<op>.remote(*args)`` as a future failing with a :class:`RemoteCallError`
        that names ``server`` (:class:`~distopt.ps.transport.base.Transport`)."""
        out: Future = Future()
        prefix = f"{what} on {server} failed"
        try:
            if op not in METHODS:
                raise RemoteCallError(f"{prefix}: {op!r} has no Ray actor method")
            handle = self.handles.get(server)
            if handle is None:
                raise RemoteCallError(f"{prefix}: no server actor named {server!r}")
            ref = getattr(handle, op).remote(*to_wire(args))
            answer = ref.future()
        except Exception as err:  # reported at the wait, like every other failure
            out.set_exception(
                err
                if isinstance(err, RemoteCallError)
                else RemoteCallError(f"{prefix}: {ray_message(err)}")
            )
            return out
        with self._cond:
            key = next(self._ids)
            self._pending[key] = (out, prefix, timeout_s)
            self._unanswered.add(key)
            heapq.heappush(self._deadlines, (time.monotonic() + timeout_s, key))
            self._cond.notify()
        answer.add_done_callback(lambda fut: self._queue(key, fut))
        return out

    def ask_all(self, op: str, args: tuple[Any, ...], timeout_s: float) -> dict[str, Any]:
        """``op(*args)`` on every actor at once, outside the reactor (recovery asks actors that
        may be dead or restarting): each answer, or its exception, by server; ``None`` for no
        answer within ``timeout_s``."""
        refs = {
            name: getattr(handle, op).remote(*to_wire(args))
            for name, handle in self.handles.items()
        }
        ready, _ = ray.wait(list(refs.values()), num_returns=len(refs), timeout=timeout_s)
        out: dict[str, Any] = {}
        for name, ref in refs.items():
            if ref not in ready:
                out[name] = None
                continue
            try:
                out[name] = from_wire(ray.get(ref))
            except Exception as err:
                out[name] = err
        return out

    def close(self) -> None:
        """Stop the reactor; calls still pending fail (the client is leaving the job)."""
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join()

    def quiesce(self, timeout_s: float) -> int:
        """Wait up to ``timeout_s`` until Ray has answered every call sent so far, also those
        already failed by their deadline (so none reaches an actor later); how many have not."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self._unanswered and (left := deadline - time.monotonic()) > 0:
                self._cond.wait(left)
            return len(self._unanswered)

    def _queue(self, key: int, answer: concurrent.futures.Future[Any]) -> None:
        """Ray's callback thread: hand the answer to the reactor, nothing else."""
        with self._cond:
            self._answers.append((key, answer))
            self._unanswered.discard(key)
            self._cond.notify_all()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._answers and not self._closed and not self._expired():
                    wait_s = self._deadlines[0][0] - time.monotonic() if self._deadlines else None
                    self._cond.wait(wait_s)
                if self._closed:
                    pending, self._pending = self._pending, {}
                    break
                answers = list(self._answers)
                self._answers.clear()
                done: list[
                    tuple[tuple[Future, str, float] | None, concurrent.futures.Future[Any] | None]
                ]
                done = [(self._pending.pop(key, None), answer) for key, answer in answers]
                done += [(self._pending.pop(key, None), None) for key in self._pop_expired()]
            for entry, answer in done:
                if entry is not None:  # None: already failed by its deadline, or answered
                    _complete(*entry, answer)
        for out, prefix, _ in pending.values():
            out.set_exception(RemoteCallError(f"{prefix}: the client left the job"))

    def _expired(self) -> bool:
        return bool(self._deadlines) and self._deadlines[0][0] <= time.monotonic()

    def _pop_expired(self) -> list[int]:
        keys, now = [], time.monotonic()
        while self._deadlines and self._deadlines[0][0] <= now:
            _, key = heapq.heappop(self._deadlines)
            if key in self._pending:
                keys.append(key)
        return keys


def _complete(
    out: Future, prefix: str, timeout_s: float, answer: concurrent.futures.Future[Any] | None
) -> None:
    """Complete ``out`` with the actor's answer, its error, or (``answer is None``) the timeout."""
    if answer is None:
        out.set_exception(
            RemoteCallError(
                f"{prefix}: no answer within {timeout_s:g} s (ps.rpc_timeout_s): the server is "
                "slow, stuck or gone"
            )
        )
        return
    try:
        value = answer.result()
    except Exception as err:
        out.set_exception(RemoteCallError(f"{prefix}: {ray_message(err)}"))
        return
    out.set_result(from_wire(value))
