"""Run a model's remote calls once, for real, and keep their results in call order.

Verification runs the original model and the optimized one on the same inputs. Remote calls must
not run twice: a write would be applied twice, and a server drawing random numbers (dropout in a
remote module) would answer differently. So the original runs under :func:`recording`, which
performs every remote call and keeps its result, and the optimized graph runs under
:class:`distopt.remote.replay.Replay`, which answers each call from that recording.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.fx

from distopt.errors import VerificationError
from distopt.remote import registry
from distopt.remote.intercept import call_frame, calling_through, intercepted
from distopt.remote.registry import RemoteCallSpec
from distopt.where import defined_at, user_line

CALL_INDEX = "distopt_call"
"""``node.meta`` key: a remote call's position among the model's remote calls, in the order the
model makes them; a batched issue holds the list of its members' positions."""


@dataclasses.dataclass
class RemoteCallRecord:
    fn: Callable[..., Any]
    """What the model called: a blocking remote function or an issue (``rpc_async``...)."""
    value: Any
    """What it returned: the result, or the future/RRef of an issue."""
    args: tuple[Any, ...] | None = None
    kwargs: dict[str, Any] | None = None
    """The call's arguments (Dynamo sites are keyed by them)."""
    spec: RemoteCallSpec | None = None
    """The call's spec: its ``wait`` resolves what an issue returned (a Ray ``ObjectRef``)."""


@dataclasses.dataclass(frozen=True)
class RemoteWrite:
    """A remote write a check will not send: what the model calls, where, and what it runs."""

    call: str
    """The remote call as the user writes it (``rpc_sync``, ``ray_call``, ``fetch``...)."""
    where: str
    """The user's source line of the call."""
    undeclared: Any = None
    """The function run on the server when only the lack of a declaration makes the call a
    write (:func:`distopt.remote.registry.undeclared_write`); ``None`` for declared writes."""

    def describe(self) -> str:
        """``rpc_sync of apply_gradient (defined at f.py:9) at model.py:57: rpc.rpc_sync(...)``."""
        runs = ""
        if self.undeclared is not None:
            name = getattr(self.undeclared, "__qualname__", None) or repr(self.undeclared)
            defined = defined_at(self.undeclared)
            runs = f" of {name}" + (f" (defined at {defined})" if defined else "")
        return f"{self.call}{runs} at {self.where}"


def remote_write(
    spec: RemoteCallSpec, args: Sequence[Any], kwargs: Mapping[str, Any], where: str
) -> RemoteWrite:
    """The :class:`RemoteWrite` of a call of ``spec`` with these arguments."""
    call = getattr(spec.fn, "__name__", None) or spec.name
    return RemoteWrite(call, where, registry.undeclared_write(spec, args, kwargs))


class RemoteWriteRefused(VerificationError):
    """A run that must not change remote state reached a remote write (before sending it)."""

    def __init__(self, write: RemoteWrite, *, in_backward: bool = False) -> None:
        super().__init__(write.describe())
        self.write = write
        self.in_backward = in_backward
        """Backward made the call (inside :func:`backward_pass`; the forward sent no write)."""


@dataclasses.dataclass
class Recording:
    calls: list[RemoteCallRecord] = dataclasses.field(default_factory=list)
    not_applied: list[RemoteWrite] = dataclasses.field(default_factory=list)
    """Remote writes not applied (``recording(write_cost_s=...)``): a stand-in sent in their
    place, or :attr:`waited_out`."""
    waited_out: list[RemoteWrite] = dataclasses.field(default_factory=list)
    """Those of :attr:`not_applied` with no stand-in sent: waited out at ``write_cost_s``."""
    blocking_s: list[float] = dataclasses.field(default_factory=list)
    """Seconds each blocking call of :attr:`calls` took (an issue's are not here)."""
    backward_writes: list[RemoteWrite] = dataclasses.field(default_factory=list)
    """Remote writes made inside :func:`backward_pass` (sent, or refused there)."""


_IN_BACKWARD: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "distopt_in_backward", default=False
)


@contextlib.contextmanager
def backward_pass() -> Iterator[None]:
    """Inside: the recorded model's backward runs (on this thread, as autograd runs a CPU
    graph's backward on the thread that called it): its remote writes are backward writes."""
    token = _IN_BACKWARD.set(True)
    try:
        yield
    finally:
        _IN_BACKWARD.reset(token)


def entry_points() -> dict[int, RemoteCallSpec]:
    """Blocking remote functions and issues (what a model calls to start a remote operation),
    with their specs."""
    found: dict[int, RemoteCallSpec] = {}
    for spec in registry.registered_specs():
        for fn in (spec.fn, spec.issue, spec.batched):
            if fn is not None:
                found.setdefault(id(fn), spec)
    return found


@contextlib.contextmanager
def recording(
    root: Any, *, allow_writes: bool = True, write_cost_s: float | None = None
) -> Iterator[Recording]:
    """Inside: ``root``'s remote calls (on this thread) run for real and are recorded in order.

    Only the outermost call counts: the ``rpc_async`` a ``RemoteModule`` makes inside its
    ``forward`` belongs to that one call. Waits and other leaves run unrecorded. With
    ``allow_writes=False`` a remote write raises :class:`RemoteWriteRefused` before it is sent;
    with ``write_cost_s`` too, a write is not applied either, and a timing run sees what it would
    cost: its spec's :attr:`~RemoteCallSpec.stand_in` is sent (its arguments to its server, which
    only counts them) and the call answers ``None`` — as a future when the write was issued
    (``rpc_async``); without a stand-in this thread waits ``write_cost_s`` instead, or an issued
    one answers that long after it was issued (:attr:`Recording.not_applied` lists them; a model
    that uses a write's answer fails that run; a write issued through another library's handle
    is refused).
    """
    entries: dict[int, RemoteCallSpec] = {}
    record = Recording()

    def handler(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        spec = entries.get(id(fn))
        write: RemoteWrite | None = None
        watched = not allow_writes or _IN_BACKWARD.get()  # else a write is sent, unremarked
        if spec is not None and fn is not spec.batched and watched:
            if registry.effect_of(spec, args, kwargs) == "write":
                where = user_line(call_frame(sys._getframe(1))) or "an unknown line"
                write = remote_write(spec, args, kwargs, where)
                if _IN_BACKWARD.get():
                    record.backward_writes.append(write)
        if write is not None and not allow_writes:
            assert spec is not None  # write is set only for a spec's call
            if write_cost_s is None:
                raise RemoteWriteRefused(write, in_backward=_IN_BACKWARD.get())
            if fn is spec.fn:
                record.not_applied.append(write)
                if not _answered(_send_stand_in(spec, args, kwargs)):
                    record.waited_out.append(write)
                    time.sleep(write_cost_s)
                return None
            if fn is spec.issue and spec.wait is _TORCH_FUTURE_WAIT:
                record.not_applied.append(write)
                sent = _send_stand_in(spec, args, kwargs)
                if sent is None:
                    record.waited_out.append(write)
                    return _answered_later(write_cost_s)
                return sent.then(lambda _: None)  # None, whether the stand-in ran or failed
            raise RemoteWriteRefused(write, in_backward=_IN_BACKWARD.get())
        start = time.perf_counter()
        with calling_through():
            value = fn(*args, **kwargs)
        if spec is not None:
            record.calls.append(RemoteCallRecord(fn, value, args, kwargs, spec))
            if fn is spec.fn:
                record.blocking_s.append(time.perf_counter() - start)
        return value

    with intercepted(root, handler):
        entries.update(entry_points())  # helpers found on the way in are entry points too
        yield record


_TORCH_FUTURE_WAIT = registry.wait_future
"""The wait of issues answering a torch future (read here once: inside a routed block the
registry's name answers with its routed wrapper)."""


def _send_stand_in(
    spec: RemoteCallSpec, args: Sequence[Any], kwargs: Mapping[str, Any]
) -> torch.futures.Future | None:
    """The future of a write's :attr:`~RemoteCallSpec.stand_in`, sent; ``None`` when the spec has
    none or it could not be sent."""
    if spec.stand_in is None:
        return None
    try:
        with calling_through():  # the stand-in's own rpc_async is not the model's call
            return spec.stand_in(args, kwargs)
    except Exception:
        return None


def _answered(sent: torch.futures.Future | None) -> bool:
    """Whether a stand-in was sent and answered (a server that failed it: ``False``)."""
    if sent is None:
        return False
    try:
        sent.wait()
    except Exception:
        return False
    return True


def _answered_later(seconds: float) -> torch.futures.Future:
    """A future that answers ``None`` after ``seconds``: an issued write not sent."""
    future: torch.futures.Future = torch.futures.Future()
    timer = threading.Timer(seconds, future.set_result, args=(None,))
    timer.daemon = True
    timer.start()
    return future


def awaited(value: Any, spec: RemoteCallSpec | None) -> Any:
    """What an issued request stands for once it has answered: a future's value, an RRef's
    value, or ``spec.wait`` of another library's handle (a Ray ``ObjectRef``); ``value`` itself
    when it is a result already."""
    if isinstance(value, torch._C.Future):  # rpc_async's futures are the C++ class itself
        return value.wait()
    if hasattr(value, "to_here") and callable(value.to_here):
        return value.to_here()
    if spec is not None:
        with calling_through():
            return spec.wait(value)
    return value
