"""Future plumbing for the client: RPCs whose errors name the server, ordering, joins, and the
futures fetches return (:class:`FetchFuture`).

All callbacks here run on whichever thread completes a future (often an RPC thread), so they never
block: they only start non-blocking RPCs and complete other futures.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed.rpc as rpc
from torch.futures import Future

from distopt.errors import RemoteCallError
from distopt.ps import context

_WORKER_LINE = re.compile(r"On WorkerInfo\(id=\d+, name=[^)]*\):(?:\\n|\n)(.*?)(?:\\n|\n)")
_EXC_REPR = re.compile(r"^([\w.]+)\((['\"])(.*)\2\)$")


def remote_message(err: BaseException) -> str:
    """The server-side exception as one line (``KeyError: ...``), without RPC framing/traceback.

    torch re-raises a handler's exception as ``<Type>: On WorkerInfo(id=.., name=..):`` followed by
    a line with the exception's ``repr`` and the remote traceback (all escaped once more for
    ``KeyError``); the ``repr`` line is the message.
    """
    text = str(err)
    match = _WORKER_LINE.search(text)
    if match:
        line = match.group(1).replace("\\'", "'").replace('\\"', '"')
        exc = _EXC_REPR.match(line)
        return f"{exc.group(1)}: {exc.group(3)}" if exc else line
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return f"{type(err).__name__}: {lines[0]}" if lines else type(err).__name__


_TIMED_OUT = "ran for more than set timeout"
_CONNECTION_LOST = ("eof", "pipe closed", "connection reset", "connection refused", "broken pipe")


def failure_message(err: BaseException, *, timeout_s: float) -> str:
    """:func:`remote_message`, with what a timeout or a lost connection means for the job."""
    message = remote_message(err)
    if _TIMED_OUT in message:
        return (f"no answer within {timeout_s:g} s (ps.rpc_timeout_s): the server is slow, "
                "stuck or gone")
    if any(marker in message.lower() for marker in _CONNECTION_LOST):
        return f"connection lost, the server process exited or was killed ({message})"
    return message


def rpc_call(server: str, fn: Callable[..., Any], args: tuple[Any, ...], *, what: str, timeout_s: float) -> Future:
    """``rpc_async(server, fn, args)`` whose failure is a :class:`RemoteCallError` naming ``server``."""
    out: Future = Future()
    try:
        inner = rpc.rpc_async(server, fn, args=args, timeout=timeout_s)
    except Exception as err:  # agent gone, unknown worker name: report at the wait like the rest
        message = failure_message(err, timeout_s=timeout_s)
        out.set_exception(RemoteCallError(f"{what} on {server} failed: {message}"))
        return out

    def done(fut: Future) -> None:
        try:
            out.set_result(fut.value())
        except Exception as err:
            message = failure_message(err, timeout_s=timeout_s)
            out.set_exception(RemoteCallError(f"{what} on {server} failed: {message}"))

    inner.add_done_callback(done)
    return out


def when_all(futures: Sequence[Future], callback: Callable[[], None]) -> None:
    """Call ``callback()`` once every future in ``futures`` is done (successfully or not)."""
    pending = [f for f in futures if not f.done()]
    if not pending:
        callback()
        return
    remaining = [len(pending)]
    lock = threading.Lock()

    def one(_: Future) -> None:
        with lock:
            remaining[0] -= 1
            last = remaining[0] == 0
        if last:
            callback()

    for fut in pending:
        fut.add_done_callback(one)


def first_error(futures: Sequence[Future]) -> BaseException | None:
    """The exception of the first failed (done) future, else ``None``."""
    for fut in futures:
        try:
            fut.value()
        except Exception as err:
            return err
    return None


def after(
    out: Future,
    *,
    writes: Sequence[Future],
    reads: Sequence[Future],
    start: Callable[[], Future],
    finish: Callable[[Any], Any],
    what: str,
) -> None:
    """Start ``start()`` once ``writes`` and ``reads`` are done; complete ``out`` with ``finish``.

    A failed earlier write fails ``out`` too (the table's state is unknown); a failed read does not
    matter to later operations.
    """

    def go() -> None:
        failed = first_error(writes)
        if failed is not None:
            out.set_exception(RemoteCallError(f"{what}: an earlier push to the table failed: {failed}"))
            return
        try:
            inner = start()
        except Exception as err:
            out.set_exception(err if isinstance(err, RemoteCallError) else RemoteCallError(f"{what}: {err}"))
            return

        def done(fut: Future) -> None:
            try:
                out.set_result(finish(fut.value()))
            except Exception as err:
                out.set_exception(err if isinstance(err, RemoteCallError) else RemoteCallError(f"{what}: {err}"))

        inner.add_done_callback(done)

    when_all([*writes, *reads], go)


def gather(parts: Sequence[Future]) -> Future:
    """A future of ``[part values]``, failing with the first part's error once all are done."""
    out: Future = Future()

    def done() -> None:
        failed = first_error(parts)
        if failed is not None:
            out.set_exception(failed)
        else:
            out.set_result([p.value() for p in parts])

    when_all(parts, done)
    return out


class FetchFuture(Future):
    """A pending fetch of one table (``single``) or of several (a batched fetch).

    Resolve it with :func:`distopt.ps.wait`, which returns the rows as autograd leaves and records them for
    :func:`distopt.ps.push_gradients`; ``fut.wait()`` returns the raw rows (no recording).
    """

    def __init__(self, requests: tuple[tuple[str, torch.Tensor], ...], *, single: bool, label: str,
                 stale: bool = False) -> None:  # fmt: skip
        super().__init__()
        self.requests = requests
        self.single = single
        self.label = label
        self.stale = stale
        """Issued under :func:`distopt.ps.client.stale_reads`: later pushes do not wait for it."""
        self._leaves: Any = None
        self._leaves_lock = threading.Lock()
        self.copied: Any = None
        """CUDA event recorded after the rows' host-to-device copy (``None`` on the CPU)."""

    def leaves(self, value: Any) -> Any:
        """The fetched rows as leaves, made (and recorded) once however often this is called."""
        with self._leaves_lock:
            if self._leaves is None:
                rows = [value] if self.single else list(value)
                if self.copied is not None:  # the copy ran on the side stream: order after it
                    stream = torch.cuda.current_stream(rows[0].device)
                    stream.wait_event(self.copied)
                    for r in rows:
                        r.record_stream(stream)  # its memory is used on this stream from now on
                track = torch.is_grad_enabled()
                made = []
                for (table, ids), r in zip(self.requests, rows, strict=True):
                    leaf = r.detach().requires_grad_(track)
                    if track:
                        context.record(table, ids, leaf)
                    made.append(leaf)
                self._leaves = made[0] if self.single else made
            return self._leaves
