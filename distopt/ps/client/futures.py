"""Future plumbing for the client: starting a request once those it is ordered after are done,
joining the answers of several servers, and the futures fetches return (:class:`FetchFuture`).

All callbacks here run on whichever thread completes a future (often an RPC thread), so they never
block: they only start non-blocking RPCs and complete other futures.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.futures import Future

from distopt.errors import RemoteCallError
from distopt.ps.client import context


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

    def fail(err: BaseException) -> None:
        """Complete ``out`` with ``err`` (as a :class:`RemoteCallError` naming the call), and
        raise ``err`` again when it is not an error of the call: Ctrl-C (KeyboardInterrupt) or
        SIGTERM turned into SystemExit. ``out`` is in its tables' order: left pending, every
        later call of those tables and every flush would wait for it forever (a bench's flush
        on the way out once did, and the bench outlived its signal). Raised inside a callback
        PyTorch runs, the interrupt is logged and dropped there; ``out`` is failed all the same."""
        if not out.done():
            if isinstance(err, RemoteCallError):
                out.set_exception(err)
            else:
                detail = err if isinstance(err, Exception) else type(err).__name__
                out.set_exception(RemoteCallError(f"{what}: {detail}"))
        if not isinstance(err, Exception):
            raise err

    def go() -> None:
        failed = first_error(writes)
        if failed is not None:
            out.set_exception(
                RemoteCallError(f"{what}: an earlier push to the table failed: {failed}")
            )
            return
        try:
            inner = start()
        except BaseException as err:
            fail(err)
            return

        def done(fut: Future) -> None:
            try:
                out.set_result(finish(fut.value()))
            except BaseException as err:
                fail(err)

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

    def __init__(
        self,
        requests: tuple[tuple[str, torch.Tensor], ...],
        *,
        single: bool,
        label: str,
        stale: bool = False,
    ) -> None:
        super().__init__()
        self.requests = requests
        self.single = single
        self.label = label
        self.stale = stale
        """Issued under :func:`distopt.ps.client.ordering.stale_reads`: later pushes do not wait for it."""
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
