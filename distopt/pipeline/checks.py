"""What :class:`~distopt.pipeline.TrainPipeline` refuses before any step runs, as one-line reasons.

Exact mode (``staleness=0``) prefetches after the step's forward and ``push`` are done, so any
read is exact. With ``staleness >= 1`` a read runs ahead of writes, and the pipeline must be able
to count what it missed. It counts only ``distopt.ps`` pushes, against ``distopt.ps`` reads
(:mod:`distopt.pipeline.prefetch`). A read made another way (``rpc_sync``, an RRef, a
``RemoteModule``) is *uncounted*: it may run ahead only of writes that cannot touch it.

* ``staleness >= 1`` with ``push=``: the read runs ahead of ``push``, whose writes are invisible
  (a user RPC may update the very rows it reads), so an uncounted read is refused;
* ``staleness >= 1`` when the model's backward sends remote writes (an autograd function that
  pushes its rows' gradients with ``rpc_sync``, as verification found when it ran the backward):
  the read runs ahead of that backward, whose writes are unseen in the same way;
* ``staleness >= 2``: the read of batch ``k + s`` is issued before the forward of the steps in
  between, so it crosses the forward's remote writes; an uncounted one that the passes say
  conflicts with it (same resource, or unknown) is refused. ``staleness=1`` crosses none: the
  forward's writes are waited inside the forward, before the prefetch.

A model ``distopt.optimize`` compiled with Dynamo or returned as written has no graph to split:
:func:`not_captured` says which, and why.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc
import torch.fx
from torch import nn
from torch.fx import Node

from distopt.pipeline.split import issue_line, prefetchable
from distopt.ps.client import calls
from distopt.remote.ops import RemoteOp, conflicts, remote_ops
from distopt.report import report_of


def is_counted(op: RemoteOp) -> bool:
    """A ``distopt.ps`` fetch (single or batched): the journal counts the pushes its rows miss."""
    return op.spec.fn is calls.fetch


def _is_counted_write(op: RemoteOp) -> bool:
    return op.spec.fn is calls.push


def uncounted_reads(gm: torch.fx.GraphModule) -> list[tuple[Node, RemoteOp]]:
    """The prefetchable reads of ``gm`` whose staleness the pipeline cannot count, in graph order."""
    ops = remote_ops(gm.graph)
    return [(issue, ops[issue]) for issue, _ in prefetchable(gm) if not is_counted(ops[issue])]


def staleness_problem(
    gm: torch.fx.GraphModule,
    staleness: int,
    *,
    push: bool,
    backward_writes: Sequence[str] = (),
) -> str | None:
    """Why ``gm`` cannot run ``staleness`` steps ahead with its staleness counted, or ``None``.

    ``push``: the pipeline calls a user ``push`` each step (its writes are unseen).
    ``backward_writes``: the remote writes ``gm``'s backward sends, described
    (:attr:`~distopt.report.OptimizeReport.backward_writes`; unseen too)."""
    if staleness == 0:
        return None
    uncounted = uncounted_reads(gm)
    if not uncounted:
        return None
    issue, op = uncounted[0]
    if push:
        return (
            f"staleness={staleness} cannot count what the read {_named(issue, op)} misses: it would "
            "run before push=, whose writes are unseen (only distopt.ps pushes are counted, for "
            "distopt.ps reads); use staleness=0 (exact)"
        )
    if backward_writes:
        return (
            f"staleness={staleness} cannot count what the read {_named(issue, op)} misses: it would "
            f"run before the backward's remote writes, which it does not see ({backward_writes[0]}; "
            "only distopt.ps pushes are counted, for distopt.ps reads); use staleness=0 (exact)"
        )
    if staleness >= 2:
        ops = remote_ops(gm.graph)
        writes = {id(w): w for w in ops.values() if w.is_write and not _is_counted_write(w)}
        for read, read_op in uncounted:
            crossed = next((w for w in writes.values() if conflicts(w, read_op)), None)
            if crossed is not None:
                return (
                    f"staleness={staleness} cannot count what the read {_named(read, read_op)} misses: "
                    f"it would run before the write {issue_line(crossed.start)} of the steps in "
                    "between (only distopt.ps pushes are counted); use staleness <= 1"
                )
    return None


def _named(issue: Node, op: RemoteOp) -> str:
    return f"{issue_line(issue)} ({op.spec.name})"


def not_captured(model: nn.Module) -> str:
    """Why ``model`` (not a ``GraphModule``) has no graph to split, naming what distopt.optimize did."""
    report = report_of(model)
    if report is None:
        return (
            "is not a result of distopt.optimize, whose captured graph the pipeline splits; pass "
            "distopt.optimize(model, example_inputs)"
        )
    if report.fallback is not None:
        return (
            f"was returned unoptimized by distopt.optimize ({_one_line(report.fallback)}), so "
            "there is no graph to split"
        )
    if report.tier == "dynamo":
        why = f" ({_one_line(report.reason)})" if report.reason else ""
        return (
            f"was compiled with Dynamo by distopt.optimize{why}; the pipeline splits only "
            "symbolically traced graphs"
        )
    return f"is not a captured graph (distopt.optimize tier {report.tier!r})"


def no_slot_reason(gm: torch.fx.GraphModule) -> str:
    """Why ``gm`` has nothing to prefetch (it has no prefetchable read), naming its first read."""
    ops = remote_ops(gm.graph)
    reads = [op for node, op in ops.items() if node is op.start and not op.is_write]
    if not reads:
        return "has no remote read; nothing to prefetch"
    return (
        f"has {len(reads)} remote read(s) but none whose arguments come from its inputs alone "
        f"(first: {issue_line(reads[0].start)}); nothing to prefetch"
    )


def in_dist_autograd() -> bool:
    """True inside ``torch.distributed.autograd.context()`` on this thread: the RPC tutorials'
    training loop, which the pipeline cannot drive (it would send the next batch's reads in this
    step's context, and it trains with ``loss.backward()``).

    Called every step, so the common answer must not cost an error: asking for this thread's
    context raises when it has none, and a C++ error took 0.068 ms per step in a trainer with
    RPC's threads up (docs/cost_model.md). No RPC agent, or no context in the process, answers
    without one."""
    if not (dist_autograd.is_available() and rpc.is_available()):
        return False
    if not rpc.api._is_current_rpc_agent_set():
        return False
    if int(dist_autograd._get_debug_info()["num_autograd_contexts"]) == 0:
        return False
    try:
        dist_autograd._current_context()
    except RuntimeError:  # the process has contexts, this thread has none
        return False
    return True


def _one_line(text: str) -> str:
    return " ".join(text.split())
