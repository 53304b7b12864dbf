"""``predict_gain``: what the tools report about an optimized model (the trainer's QPS-log header,
``distopt explain --ps-latency-ms``, the ps_overlap benchmark).

It captures the model as written (with :func:`distopt.optimize`, no passes), predicts the forward
before and after with the cost model of :mod:`distopt.estimate`, and optionally measures a
forward+backward of the model to turn the forward saving into a step gain. It lives here, above
the cost model, because it captures and because a pipelined prediction needs the pipeline's split.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import logging
import statistics
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Any, Literal, TypeVar, cast

import torch
import torch.distributed as dist
import torch.fx
from torch import nn

from distopt.errors import ConfigError
from distopt.estimate.ab import now
from distopt.estimate.predict import (
    GainPrediction,
    Prediction,
    fx_graphs,
    input_tuple,
    pipeline_window_s,
    predict,
    staleness_to_hide,
)
from distopt.estimate.rounds import round_interval
from distopt.estimate.step import (
    LOGGED,
    OTHER,
    PushMode,
    StepCosts,
    StepPrediction,
    other_s,
    predict_step,
)
from distopt.estimate.timeline import Timeline, simulate
from distopt.optimize.api import optimize
from distopt.pipeline.prefetch import Prefetcher
from distopt.pipeline.slots import provided
from distopt.pipeline.split import PrefetchSplit, prefetchable
from distopt.pipeline.train_pipeline import check_pipelined
from distopt.ps.client import calls as ps_calls
from distopt.ps.client import context as ps_context
from distopt.ps.client.cache import TableCache, memory_available
from distopt.remote import registry
from distopt.remote.intercept import calling_through
from distopt.remote.isolation import forked_rng, isolated, preserved_state
from distopt.remote.local import named_local_tensors, with_remote_calls
from distopt.remote.record import Recording, RemoteWriteRefused, recording

logger = logging.getLogger(__name__)

T = TypeVar("T")


def predict_pipelined(
    optimized: torch.fx.GraphModule, forward: Prediction, window_s: float
) -> Timeline:
    """The optimized forward whose prefetchable reads were sent ``window_s`` earlier."""
    early = {issue.name: window_s for issue, _ in prefetchable(optimized)}
    return simulate(optimized, forward.after_costs, forward.latency, head_start_s=early)


REHEARSAL_ROUNDS = 3
"""Rounds of the rehearsal, at least: each runs a chunk of steps of every schedule in turn, so
that a host getting faster or slower during it favours none."""

REHEARSAL_SETTLE_ROUNDS = 6
"""Rounds of a settling rehearsal (``settle=True``), at least, unless :data:`REHEARSAL_MAX_S`
has passed. Three rounds that agree are not three samples of the host: its slow and fast spells
last seconds, so three half-second rounds often sit in one, and their interval is too narrow.
Over 16 ps_overlap sweeps, a gain taken from 3 consecutive rounds of the run itself was more
than 15% off the whole run's gain in 2.0% of windows at light points (pipelined; p99 17.9%),
from 6 in 0.6% (p99 12.1%), from 9 in 0.3% (docs/cost_model.md, *Three rounds in one spell*)."""

REHEARSAL_MAX_ROUNDS = 12
"""Rounds of a settling rehearsal (``settle=True``), at most: after
:data:`REHEARSAL_SETTLE_ROUNDS` it goes on while a schedule's gain over the first is not known
within :data:`REHEARSAL_SPREAD`. A pipelined step on a shared 2-core host is slow or fast for
seconds at a time (K = 1, 1 ms, light: round medians of 3.0 to 6.4 ms for one schedule, minutes
apart): three rounds predicted its gain with a spread of 11% against a run's minutes (issue 24's
sweeps), where the interleaved optimized schedule, whose steps vary less, had 5%."""

REHEARSAL_SPREAD = 0.05
"""A settling rehearsal ends once each gain's 90% interval over rounds (a bootstrap over whole
rounds: :func:`distopt.estimate.rounds.round_interval`) lies within ±5% of its middle."""

REHEARSAL_MAX_S = 30.0
"""Seconds a settling rehearsal adds rounds for, at most (the job waits for it at start-up)."""

REHEARSAL_CHUNK_S = 0.5
"""Counted seconds per chunk, at least (and at least the chunk's steps): a step of a few
milliseconds on a shared 2-core host varies by a third from one step to the next, and a
pipeline's first steps after its fill find their reads early. Measured (ps_overlap K = 1, 5 ms,
light, staleness 4): 2 counted pipelined steps per round predicted an 18 ms step one run and a
7 ms step the next, where the run's steady state was 9.6 ms; medians of 5 steps ranged from 5 to
16 ms."""

REHEARSAL_MAX_STEPS = 500
"""Counted steps per chunk, at most (a step of microseconds must not rehearse forever)."""

REHEARSAL_BATCHES = 256
"""Batches a job rehearses on, at most (its first ones; :data:`REHEARSAL_BATCHES_BYTES` at
most): each step takes the next, as the job's steps do. Steps that take few batches over and
over touch few rows (which likely stay in the trainer's and the servers' CPU caches) and run
short: on one batch repeated a pipelined step was 7–17% shorter than on 30 distinct ones
(ps_overlap K = 4, 1 ms, light; 4 distinct ones were as short as one), and on 30 its steps were
still rehearsed 26–40% shorter than ps_overlap's run of 40–250-step chunks timed them (K = 16,
1 ms, light: optimized 11.4 against 14.3 ms, pipelined 9.9 against 13.9); on 256, 14.0 against
14.8 and 13.4 against 13.4 (docs/cost_model.md)."""

REHEARSAL_BATCHES_BYTES = 64 << 20
"""Bytes of tensors in the rehearsal's batches, at most, beyond the first batch: they are held
on the trainer's device while it rehearses."""


def read_ahead(
    stream: Iterator[T], nbytes: Callable[[T], int], *, most: int = REHEARSAL_BATCHES - 1
) -> tuple[list[T], int]:
    """The batches a job rehearses on after its first: up to ``most`` (at most
    :data:`REHEARSAL_BATCHES` − 1) read from ``stream``, and how many of them, in order, fit
    :data:`REHEARSAL_BATCHES_BYTES` (``nbytes`` of each; the last one read may not: reading it
    told). The caller trains on every one read, so a job passes no more than it will take."""
    ahead: list[T] = []
    fit = held = 0
    for batch in itertools.islice(stream, max(0, min(most, REHEARSAL_BATCHES - 1))):
        ahead.append(batch)
        held += nbytes(batch)
        if held > REHEARSAL_BATCHES_BYTES:
            break
        fit += 1
    return ahead, fit


Backward = Callable[[torch.Tensor], None]
StepScope = Callable[[], AbstractContextManager[Backward]]
"""Around each rehearsed step: a context whose value runs the step's backward from its loss
(``dist_autograd``'s context and ``dist_autograd.backward`` for a model trained that way)."""


@contextlib.contextmanager
def local_backward() -> Iterator[Backward]:
    """The default :data:`StepScope`: ``loss.backward()``."""
    yield lambda loss: loss.backward()


class Lockstep:
    """A job's trainers rehearsing together, in step as they train: each rehearsed step's
    backward ends in the job's gradient all-reduce, in-turn pushes go one trainer after the
    other with a barrier after each turn, and every chunk runs as many steps on every trainer
    (they agree after each step). Rehearsing alone, a trainer timed its compute while the
    others' steps were out of phase with its own, and its push while every trainer pushed at
    once; on dlrm_criteo the optimized step's forward came out 30% short and the pushes 24%
    long (docs/cost_model.md). Every trainer of ``group`` must rehearse with one."""

    def __init__(self, group: Any = None, *, gradient_bytes: int = 0) -> None:
        self.group = group
        """The trainers' process group (``None``: the default group)."""
        self.gradient_bytes = gradient_bytes
        """Dense gradient bytes the job all-reduces per step (DDP; 0: none)."""
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        self._gradients = torch.zeros(-(-gradient_bytes // 4), dtype=torch.float32)

    def all_reduce(self) -> None:
        """The step's gradient all-reduce (a buffer of the gradients' bytes, in one call)."""
        if self.gradient_bytes:
            dist.all_reduce(self._gradients, group=self.group)

    def in_turn(self, push: Callable[[], None]) -> Callable[[], None]:
        """``push`` sent as the job's deterministic pushes are: rank by rank, a barrier after
        each turn."""

        def in_turn() -> None:
            for turn in range(self.size):
                if turn == self.rank:
                    push()
                dist.barrier(group=self.group)

        return in_turn

    def agree(self, holds: bool) -> bool:
        """Whether ``holds`` on every trainer (a chunk ends when every trainer is done with it)."""
        flag = torch.tensor([int(holds)])
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.group)
        return bool(flag.item())


REHEARSED: tuple[str, ...] = (*LOGGED, "step")
"""What a rehearsed step times (``waits`` inside ``forward``, ``all_reduce`` inside ``backward``;
``step`` from its start to its end, the untimed work between its phases included)."""

OptimizerBuilder = Callable[[list[nn.Parameter]], torch.optim.Optimizer]
"""The job's optimizer, built over the parameters it is given (``torch.optim.SGD(params, lr=…)``)."""


class OptimizerOnCopies:
    """The job's optimizer stepping copies of a module's parameters with the gradients the
    rehearsed step just computed: its step costs what the job's costs, where the job pays it
    (after the step's pushes, with the servers busy and the next batches' reads in flight), and
    the user's parameters and optimizer state stay untouched. Timed alone on idle copies it came
    out 2-4x short of the job's (ps_overlap, RPC, 2026-11-28: 0.13 against 0.46 ms at K = 1,
    heavy; 5.3 against 10.2 ms at K = 16, heavy)."""

    def __init__(self, module: nn.Module, build: OptimizerBuilder) -> None:
        self._pairs = [(param, nn.Parameter(param.detach().clone())) for param in _trained(module)]
        self._optimizer = build([copy for _, copy in self._pairs]) if self._pairs else None

    def step(self) -> None:
        if self._optimizer is None:
            return
        for param, copy in self._pairs:
            copy.grad = param.grad
        self._optimizer.step()
        for _, copy in self._pairs:
            copy.grad = None  # the gradients are the step's: not held past it


COPY_BYTES_PER_BYTE = 3
"""Memory an optimizer on copies may take per byte of the parameters it copies: the copy and
up to two states per parameter (Adam's moments)."""


def _trained(module: nn.Module) -> list[nn.Parameter]:
    """The trainable parameters held here (each once; a ``RemoteModule``'s live on its owner)."""
    held = (param for _, param in named_local_tensors(module, "_parameters"))
    return [cast(nn.Parameter, param) for param in held if param.requires_grad]


def _free_bytes(device: torch.device) -> int | None:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    return memory_available() if device.type == "cpu" else None


def optimizers_on_copies(
    modules: Mapping[str, nn.Module], build: OptimizerBuilder | None
) -> dict[str, OptimizerOnCopies] | None:
    """An :class:`OptimizerOnCopies` per rehearsed schedule, or ``None`` (no optimizer step
    rehearsed) without ``build`` or when their copies and state could take more than half the
    memory free on a device: a prediction must never be what runs a job out of memory."""
    if build is None:
        return None
    needed: dict[torch.device, int] = {}
    for module in modules.values():
        for param in _trained(module):
            nbytes = param.numel() * param.element_size() * COPY_BYTES_PER_BYTE
            needed[param.device] = needed.get(param.device, 0) + nbytes
    for device, nbytes in needed.items():
        free = _free_bytes(device)
        if free is not None and nbytes > free // 2:
            logger.info(
                "prediction: the optimizer step is not rehearsed: copies of the parameters and "
                "its state could take %d MiB of the %d MiB free on %s",
                nbytes >> 20,
                free >> 20,
                device,
            )
            return None
    return {name: OptimizerOnCopies(module, build) for name, module in modules.items()}


@dataclasses.dataclass(frozen=True, slots=True)
class _Step:
    """What a rehearsed step runs, in the job's order: take the batch, clear the gradients
    (``zero_grad``), forward, backward (ending in ``all_reduce``), push, optimizer step."""

    take: Callable[[], Any]
    forward: Callable[[Any], torch.Tensor]
    push: Callable[[], None]
    clear_grads: Callable[[], None]
    scope: StepScope = local_backward
    all_reduce: Callable[[], None] | None = None
    optimizer: OptimizerOnCopies | None = None


def _timed_step(step: _Step, times: dict[str, list[float]]) -> None:
    """One rehearsed step, each of :data:`REHEARSED` that ``times`` holds appended to it (it
    holds ``optimizer`` only when the rehearsal steps an optimizer)."""
    step_start = now()
    batch = step.take()
    data = now() - step_start
    step.clear_grads()
    reduced = 0.0
    with step.scope() as backward_of:
        ps_calls.take_wait_time()
        start = now()
        loss = step.forward(batch)
        forward = now() - start
        waits = ps_calls.take_wait_time()
        start = now()
        backward_of(loss)
        if step.all_reduce is not None:
            local_end = now()
            step.all_reduce()
            reduced = now() - local_end
        backward = now() - start
        start = now()
        step.push()
        pushes = now() - start
    start = now()
    if step.optimizer is not None:
        step.optimizer.step()
    optimizer = now() - start
    seconds = {
        "data": data,
        "forward": forward,
        "waits": waits,
        "backward": backward,
        "all_reduce": reduced,
        "pushes": pushes,
        "optimizer": optimizer,
        "step": now() - step_start,
    }
    for name, values in times.items():  # the phases this rehearsal times
        values.append(seconds[name])


@contextlib.contextmanager
def _rehearsal_caches() -> Iterator[None]:
    """The job's row caches (``ps.cache``) are not the rehearsal's to fill: its steps fetch
    through empty caches of the same configuration (none where a second set would not fit in
    half the free memory), and the job's caches hold afterwards what they held before. Filled
    with the rows of the rehearsal's batches, a job's staleness-1 caches served more stale rows
    from its first step on (tests/ps/test_cache_job.py: held-out AUC 0.0026 and 0.0034 off the
    exact cache's, against 0.002)."""
    if not ps_calls.is_connected() or not ps_calls.current().caches:
        yield
        return
    held = ps_calls.current().caches
    free = memory_available()
    fits = free is not None and 2 * sum(cache.nbytes for cache in held.values()) <= free
    fresh = {
        name: TableCache(cache.spec, cache.config, num_shards=cache.num_shards)
        for name, cache in (held.items() if fits else ())
    }
    with ps_calls.using_caches(fresh):
        yield


def _clear_grads(*modules: nn.Module) -> None:
    """``zero_grad(set_to_none=True)`` of the parameters held here (a ``RemoteModule``'s live on
    its owner, and it refuses to list modules)."""
    for module in modules:
        for _, param in named_local_tensors(module, "_parameters"):
            param.grad = None


def _loss_of(view: nn.Module) -> Callable[[tuple[Any, ...]], torch.Tensor]:
    return lambda inputs: view(*inputs).float().sum()


def _dry_run_push(pushes: PushMode) -> Callable[[], None]:
    """Send the step's push as a dry run (ordered as the real one; waited for unless async)."""

    def push() -> None:
        items = ps_calls.step_pushes() if ps_calls.is_connected() else []
        ps_context.discard_step()
        if items and pushes != "none":
            with calling_through():  # known to change nothing: not one of the model's writes
                sent = ps_calls.push_many_async(items, 0.0, dry_run=True)
            if pushes != "async":
                ps_calls.wait(sent)

    return push


def rehearse(
    model: nn.Module,
    optimized: torch.fx.GraphModule,
    example_inputs: tuple[Any, ...],
    *,
    pushes: PushMode,
    baseline_pushes: PushMode | None = None,
    pipeline_staleness: int | None = None,
    max_staleness: int | None = None,
    schedules: Sequence[str] = ("baseline", "optimized"),
    steps: int,
    read_latency_s: float,
    scope: StepScope = local_backward,
    lockstep: Lockstep | None = None,
    optimizer: OptimizerBuilder | None = None,
    settle: bool = False,
    batches: Sequence[tuple[Any, ...]] = (),
) -> StepCosts:
    """Rehearse steps of ``model`` and ``optimized`` (and of ``optimized`` in a pipeline with
    ``pipeline_staleness``) on ``batches`` in turn (each a forward's positional inputs; none:
    ``example_inputs`` every step), and return their phases' medians (:class:`StepCosts`; the
    job's own parts left at 0). Steps on one batch over and over ran faster than on the job's
    batches, the pipelined step most (:data:`REHEARSAL_BATCHES`).

    A rehearsed step is a forward (grad mode; remote reads sent for real, the time blocked on
    them counted), its backward, and the step's push to distopt's servers as a dry run, sent as
    ``pushes`` says (``baseline_pushes`` for the model as written, when it pushes otherwise): the
    servers run the update's kernels on the rows, writing back what was there, and the next step's
    reads wait for it as for a real push. A remote write of the user's own in the backward is not
    sent: its stand-in is (its arguments to its server, not applied), or without one it is
    waited out at ``read_latency_s`` (:func:`recording`); one that cannot be (a write issued
    through another library's handle) raises :class:`RemoteWriteRefused` before it is sent.
    With ``optimizer``, each step ends in the job's optimizer step on copies of the parameters
    (:class:`OptimizerOnCopies`; not where they would not fit: :func:`optimizers_on_copies`),
    timed as ``optimizer``. Schedules take turns in :data:`REHEARSAL_ROUNDS` chunks of ``steps``
    steps, the first step of each chunk not counted (a pipelined chunk runs as many steps more as
    its staleness, which are not counted either: their reads were sent before its first step), each
    chunk going on until its counted steps took :data:`REHEARSAL_CHUNK_S`; with ``settle``, more
    rounds follow while the gain of a schedule over the first is not yet known within
    :data:`REHEARSAL_SPREAD` (:func:`_settled`). The backward, which the passes do not change, is
    the median over every schedule's steps but a pipeline's, and so are the pushes of schedules
    that push alike (a pipeline's backward and pushes are its own); each schedule's
    :data:`~distopt.estimate.step.OTHER` is its own steps' median less the sum of its own phases'
    medians (phases vary together: at K = 1, 5 ms, light, a pipelined step's median was 2 ms over
    the sum, 30%). The pipeline deepens as in a run when its reads arrive late, up to
    ``max_staleness`` (:attr:`StepCosts.pipeline_depth` is where it ended). Grads, buffers, the RNG
    stream and remote state such as fetched-row records are as they were afterwards. ``scope`` says
    how the model's backward runs (:data:`StepScope`; the pipeline's rehearsal always runs
    ``loss.backward()``). With ``lockstep`` every trainer of a job rehearses at once, each step
    ending as the job's does (:class:`Lockstep`).
    """
    chunk = max(2, -(-steps // REHEARSAL_ROUNDS) + 1)
    inputs = list(batches) or [example_inputs]
    known: dict[str, tuple[nn.Module, PushMode]] = {
        "baseline": (model, baseline_pushes or pushes),
        "optimized": (optimized, pushes),
        "pipelined": (optimized, pushes),
    }
    runs = {name: known[name] for name in schedules}
    split = None
    if "pipelined" in runs:
        if pipeline_staleness is None or pipeline_staleness < 1:
            raise ConfigError(
                f"rehearse: a pipelined schedule needs a staleness >= 1, got {pipeline_staleness!r}"
            )
        split = check_pipelined(optimized, pipeline_staleness, push=True)
    stepping: Mapping[str, OptimizerOnCopies | None] = optimizers_on_copies(
        {
            name: split.main if name == "pipelined" and split else module
            for name, (module, _) in runs.items()
        },
        optimizer,
    ) or dict.fromkeys(runs)
    timed = [phase for phase in REHEARSED if phase != "optimizer" or None not in stepping.values()]
    times: dict[str, dict[str, list[float]]] = {
        name: {phase: [] for phase in timed} for name in runs
    }
    all_reduce = lockstep.all_reduce if lockstep is not None else None
    not_applied = writes_waited_out = 0
    baseline_wrote: bool | None = None  # unknown until the model as written was rehearsed
    depth = pipeline_staleness or 0
    # Each round's counted step times of each schedule: the units a gain's interval draws.
    rounds: dict[str, list[list[float]]] = {name: [] for name in runs}
    started = now()
    with (
        preserved_state(model, optimized),
        isolated(),
        forked_rng(),
        _rehearsal_caches(),
    ):
        # Restored on exit; None now so that backward does not accumulate into the user's grads.
        _clear_grads(model, optimized)
        while not _settled(rounds, settle=settle, started=started, lockstep=lockstep):
            for name, (module, push_mode) in runs.items():
                view = with_remote_calls(module)
                chunk_times: dict[str, list[float]] = {phase: [] for phase in times[name]}
                with _rehearsal_recording(module, view, read_latency_s, baseline_wrote) as record:
                    push = _dry_run_push(push_mode)
                    if lockstep is not None and push_mode == "in_turn":
                        push = lockstep.in_turn(push)
                    if split is not None and name == "pipelined":
                        # The first batches' reads were sent before the chunk's first step: a
                        # chunk counts from the step whose reads an earlier step sent.
                        depth = _pipelined_chunk(
                            split,
                            inputs,
                            depth,
                            max_staleness,
                            push,
                            chunk,
                            chunk_times,
                            lockstep,
                            stepping[name],
                        )
                    else:
                        step = _Step(
                            take=functools.partial(next, itertools.cycle(inputs)),
                            forward=_loss_of(view),
                            push=push,
                            clear_grads=functools.partial(_clear_grads, module),
                            scope=scope,
                            all_reduce=all_reduce,
                            optimizer=stepping[name],
                        )
                        while not _chunk_done(chunk_times, chunk, lockstep):
                            _timed_step(step, chunk_times)
                    _clear_grads(module)
                    if ps_calls.is_connected():
                        ps_calls.flush()  # the last dry-run push belongs to this chunk
                if name == "baseline":
                    not_applied = len(record.not_applied) // len(chunk_times["forward"])
                    writes_waited_out = len(record.waited_out) // len(chunk_times["forward"])
                    baseline_wrote = bool(record.not_applied) or any(
                        registry.effect_of(call.spec, call.args or (), call.kwargs or {}) != "read"
                        for call in record.calls
                        if call.spec is not None
                    )
                for phase, values in chunk_times.items():
                    times[name][phase].extend(values[1:])
                rounds[name].append(chunk_times["step"][1:])
    # Before the pooling below: each schedule's own phases.
    other = {name: left_over(phases) for name, phases in times.items()}

    # The passes change the forward alone: each schedule's backward (and all-reduce), and its
    # pushes where it pushes as another does, are one cost measured several times, taken together.
    # Not a pipeline's: its backward and pushes run while the next batches' reads are answered
    # and served on the same cores (pooled with the others', its backward was predicted 4.12 ms
    # against 4.72 measured at ps_overlap K = 1, 5 ms, heavy, and its step 22% short).
    def own(name: str) -> bool:
        return name == "pipelined"

    for phase, same in (
        ("backward", own),
        ("all_reduce", own),
        ("pushes", lambda name: (own(name), runs[name][1])),
    ):
        pooled: dict[Any, list[float]] = {}
        for name in runs:
            pooled.setdefault(same(name), []).extend(times[name][phase])
        for name in runs:
            times[name][phase] = pooled[same(name)]
    return StepCosts(
        rehearsed={
            name: {
                **{
                    phase: statistics.median(values)
                    for phase, values in phases.items()
                    if phase != "step"
                },
                OTHER: other[name],
            }
            for name, phases in times.items()
        },
        pushes=pushes,
        trainers=lockstep.size if lockstep is not None else 1,
        all_reduce_bytes=lockstep.gradient_bytes if lockstep is not None else 0,
        writes_not_applied=not_applied,
        writes_waited_out=writes_waited_out,
        read_latency_s=read_latency_s,
        pipeline_depth=depth if split is not None else None,
        rounds=len(next(iter(rounds.values()))),
    )


def left_over(times: dict[str, list[float]]) -> float:
    """:data:`~distopt.estimate.step.OTHER` of rehearsed steps: the median ``step`` less the sum
    of the medians of its phases (phases that vary together do not add up by their medians)."""
    phases = {phase: statistics.median(values) for phase, values in times.items() if values}
    return other_s(statistics.median(times["step"]), phases)


def _rehearsal_recording(
    module: nn.Module, view: nn.Module, read_latency_s: float, baseline_wrote: bool | None
) -> AbstractContextManager[Recording]:
    """Where a rehearsed model's remote calls go: through :func:`recording`, which waits writes
    out instead of sending them. A model Dynamo compiled (no torch.fx graph) is the exception
    once the model as written was rehearsed and only read: the same code making the same calls,
    it runs them as they are, because routing them makes Dynamo guard on the wrappers and run
    them eagerly, one after the other — it would time the model as written."""
    if not isinstance(module, torch.fx.GraphModule) and baseline_wrote is False:
        return contextlib.nullcontext(Recording())
    return recording(view, allow_writes=False, write_cost_s=read_latency_s)


def _settled(
    rounds: Mapping[str, Sequence[Sequence[float]]],
    *,
    settle: bool,
    started: float,
    lockstep: Lockstep | None = None,
) -> bool:
    """Whether a rehearsal has run its rounds (``rounds[name][r]``: schedule ``name``'s counted
    step times in round ``r``): :data:`REHEARSAL_ROUNDS`; with ``settle``, at least
    :data:`REHEARSAL_SETTLE_ROUNDS` and more until the gain of every schedule over the first has
    a 90% interval within :data:`REHEARSAL_SPREAD` of its middle, at most
    :data:`REHEARSAL_MAX_ROUNDS` rounds or :data:`REHEARSAL_MAX_S` seconds (with ``lockstep``: on
    every trainer, which all decide alike)."""
    done = min(map(len, rounds.values()))
    if done < REHEARSAL_ROUNDS:
        return False
    if not settle or done >= REHEARSAL_MAX_ROUNDS:
        return True
    first, *others = rounds
    if now() - started >= REHEARSAL_MAX_S:
        settled = True
    elif done < REHEARSAL_SETTLE_ROUNDS:
        settled = False
    else:
        settled = all(
            _within_spread(
                round_interval(
                    {first: rounds[first], name: rounds[name]},
                    functools.partial(_gain, first, name),
                )
            )
            for name in others
        )
    return settled if lockstep is None else lockstep.agree(settled)


def _gain(before: str, after: str, medians: Mapping[str, Any]) -> Any:
    return medians[before] / medians[after]


def _within_spread(interval: tuple[float, float]) -> bool:
    low, high = interval
    middle = (low + high) / 2
    return high - low <= 2 * REHEARSAL_SPREAD * middle


def _chunk_done(
    times: dict[str, list[float]], steps: int, lockstep: Lockstep | None = None
) -> bool:
    """Whether a chunk has its ``steps`` steps and :data:`REHEARSAL_CHUNK_S` counted (its first
    step is not counted) or :data:`REHEARSAL_MAX_STEPS` (with ``lockstep``: on every trainer)."""
    done = len(times["forward"])
    counted = sum(sum(times[phase][1:]) for phase in ("forward", "backward", "pushes"))
    finished = done >= REHEARSAL_MAX_STEPS + 1 or (done >= steps and counted >= REHEARSAL_CHUNK_S)
    return finished if lockstep is None else lockstep.agree(finished)


def _pipelined_chunk(
    split: PrefetchSplit,
    inputs: Sequence[tuple[Any, ...]],
    staleness: int,
    max_staleness: int | None,
    push: Callable[[], None],
    steps: int,
    times: dict[str, list[float]],
    lockstep: Lockstep | None = None,
    optimizer: OptimizerOnCopies | None = None,
) -> int:
    """Rehearsed steps of the pipeline's main stage as :class:`TrainPipeline` runs them (taking
    the prefetched batch is ``data``; the next batches' reads leave in the forward), until
    :func:`_chunk_done` with ``steps`` (and ``lockstep``: :func:`rehearse`); returns the
    staleness it ended at. The first ``staleness`` steps are not in ``times``: their reads were
    sent before the chunk's first step (a chunk counts from the step whose reads an earlier step
    sent)."""
    prefetcher = Prefetcher(
        split,
        itertools.cycle(inputs),
        staleness=staleness,
        inputs=lambda batch: batch,
        max_staleness=max_staleness,
    )
    warm: dict[str, list[float]] = {phase: [] for phase in times}

    # The prefetch stage sends reads only (that is what it is made of): not the model's calls
    # to route, so a transport's own calls in it (Ray's actor methods) run as they are.
    def take() -> tuple[tuple[Any, ...], list[Any]]:
        with calling_through():
            return prefetcher.take()

    def forward(taken: tuple[tuple[Any, ...], list[Any]]) -> torch.Tensor:
        batch, issued = taken
        with provided(issued):
            loss = split.main(*batch).float().sum()
        with calling_through():
            prefetcher.before_backward()
        return loss

    def push_then_prefetch() -> None:
        push()
        with calling_through():
            prefetcher.after_push()

    step = _Step(
        take=take,
        forward=forward,
        push=push_then_prefetch,
        clear_grads=functools.partial(_clear_grads, split.main),
        all_reduce=lockstep.all_reduce if lockstep is not None else None,
        optimizer=optimizer,
    )
    try:
        with calling_through():
            prefetcher.fill()
        while not _chunk_done(times, steps, lockstep):
            _timed_step(step, warm if len(warm["forward"]) < staleness else times)
    finally:
        prefetcher.close()
    return prefetcher.stats.depth


def read_latency_s(model: nn.Module, example_inputs: tuple[Any, ...], *, runs: int = 3) -> float:
    """The median of ``model``'s blocking remote calls over ``runs`` forwards (grad off, writes
    refused, the model's state kept): a request's latency for a model without a graph to
    profile (a Dynamo-tier model); 0 when it makes none."""
    view = with_remote_calls(model)
    with (
        preserved_state(model),
        isolated(),
        forked_rng(),
        torch.no_grad(),
        recording(view, allow_writes=False) as record,
    ):
        for _ in range(runs):
            view(*example_inputs)
    return statistics.median(record.blocking_s) if record.blocking_s else 0.0


def predict_gain(
    model: nn.Module,
    optimized: nn.Module,
    example_inputs: Any,
    *,
    latency_s: float | None = None,
    measure_step: bool = False,
    repeats: int = 5,
    pipeline_staleness: int | Literal["auto"] | None = None,
    max_staleness: int = 8,
    pushes: PushMode = "async",
    baseline_pushes: PushMode | None = None,
    lockstep: Lockstep | None = None,
    optimizer: OptimizerBuilder | None = None,
    batches: Sequence[Any] = (),
    data_s: float = 0.0,
) -> GainPrediction:
    """Predict the gain of ``optimized`` (a torch.fx graph distopt made) over ``model``.

    Args:
        model: the model as written; captured here without passes for the "before" graph.
        optimized: the optimized GraphModule.
        example_inputs: positional inputs of one forward call.
        latency_s: seconds per remote request; default: each request of the model measured
            (:func:`predict`), whatever serves it.
        measure_step: also rehearse steps of both models (:func:`rehearse`: the step, phase by
            phase, in :attr:`GainPrediction.costs`); not done, and said in
            :attr:`GainPrediction.unmeasured_step`, when the step sends a remote write that
            cannot be waited out (it is never sent twice).
        repeats: timed profiling runs per graph, and rehearsed steps per schedule.
        pipeline_staleness: also predict the step of a pipeline (:mod:`distopt.pipeline`)
            with this staleness; ``"auto"``: with the least that hides a request's latency
            (:func:`staleness_to_hide`, at most ``max_staleness``), reported in the result.
        pushes: how the rehearsed steps push (``baseline_pushes`` for the model as written
            when it pushes otherwise: the ps_overlap benchmark's baseline waits for its push).
        lockstep: a job's trainers rehearse together (:class:`Lockstep`; every trainer calls
            this with one).
        optimizer: the job's optimizer: each rehearsed step ends in its step, on copies of the
            parameters (:class:`OptimizerOnCopies`); without it the step's ``optimizer`` is 0.
        batches: the positional inputs of the job's first batches (:func:`read_ahead`),
            which the rehearsed steps take in turn; none: ``example_inputs`` every step.
        data_s: seconds the job's loader takes to hand over a batch, beyond the rehearsed
            steps' own (``data`` of every schedule: :attr:`StepCosts.data_s`).

    A model or optimized model without a graph is a one-line :class:`CaptureError`, raised
    before any request is sent.
    """
    if latency_s is not None and not latency_s >= 0:
        raise ConfigError(f"latency_s: expected seconds >= 0, got {latency_s!r}")
    if not data_s >= 0:
        raise ConfigError(f"data_s: expected seconds >= 0, got {data_s!r}")
    if not (
        pipeline_staleness in (None, "auto")
        or (isinstance(pipeline_staleness, int) and pipeline_staleness >= 0)
    ):
        raise ConfigError(
            f"pipeline_staleness: expected an integer >= 0 or 'auto', got {pipeline_staleness!r}"
        )
    fx_graphs(optimized=optimized)
    example_inputs = input_tuple(example_inputs)
    with torch.no_grad():
        captured = optimize(model, passes=[], verify=False)
    fx_graphs(captured=captured, optimized=optimized)
    forward = predict(captured, optimized, example_inputs, latency_s, repeats=repeats)
    step = backward = unmeasured = costs = None
    rehearsal = functools.partial(
        rehearse,
        model,
        optimized,  # type: ignore[arg-type]  # fx_graphs checked it
        example_inputs,
        pushes=pushes,
        baseline_pushes=baseline_pushes,
        steps=repeats,
        read_latency_s=forward.rpc_latency_s,
        lockstep=lockstep,
        optimizer=optimizer,
        batches=[input_tuple(batch) for batch in batches],
    )
    if measure_step:
        try:
            # A pipeline's rehearsal below settles every schedule's step; this one then only
            # sizes the pipeline.
            costs = rehearsal(settle=pipeline_staleness is None)
        except RemoteWriteRefused as err:
            unmeasured = f"the step sends a remote write ({err.write.describe()})"
        else:
            baseline = costs.rehearsed["baseline"]
            step = baseline["forward"] + baseline["backward"]
            backward = baseline["backward"]
    pipelined = None
    automatic = pipeline_staleness == "auto"
    if pipeline_staleness == "auto":
        pipeline_staleness = staleness_to_hide(forward, step, limit=max_staleness)
    if pipeline_staleness is not None:
        window = pipeline_window_s(forward, step, pipeline_staleness)
        pipelined = predict_pipelined(optimized, forward, window)  # type: ignore[arg-type]
        piped = None
        if costs is not None and pipeline_staleness >= 1:
            try:
                # Every schedule again, in the same rounds as the pipeline: its gain is a ratio
                # of steps rehearsed side by side, not of two rehearsals seconds apart (before,
                # the pipelined step's error went with the baseline's at a correlation of 0.67,
                # the optimized one's, interleaved, at 0.92).
                piped = rehearsal(
                    schedules=("baseline", "optimized", "pipelined"),
                    pipeline_staleness=pipeline_staleness,
                    max_staleness=max_staleness if automatic else None,
                    settle=True,
                )
            except ConfigError:
                pass  # a pipeline could not run this model (TrainPipeline says why): no rehearsal
        if costs is not None and piped is not None:
            costs = piped
            depth = piped.pipeline_depth
            if automatic and depth is not None and depth != pipeline_staleness:
                # The rehearsal's reads came back late: start where it ended, as a run would.
                pipeline_staleness = depth
                window = pipeline_window_s(forward, step, pipeline_staleness)
                pipelined = predict_pipelined(optimized, forward, window)  # type: ignore[arg-type]
    if costs is not None and data_s:
        costs = dataclasses.replace(costs, data_s=data_s)
    return GainPrediction(
        forward=forward,
        measured_step_s=step,
        measured_backward_s=backward,
        costs=costs,
        unmeasured_step=unmeasured,
        pipelined=pipelined,
        pipeline_staleness=pipeline_staleness,
    )


def step_of(gain: GainPrediction) -> StepPrediction | None:
    """:func:`predict_step` from a :func:`predict_gain` made with ``measure_step=True``
    (``None`` when its step was not rehearsed); pipelined when the prediction was made for a
    pipeline."""
    if gain.costs is None:
        return None
    piped = "pipelined" in gain.costs.rehearsed
    return predict_step(gain.costs, optimized="pipelined" if piped else "optimized")
