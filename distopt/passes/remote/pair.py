"""Give remote calls users already wrote asynchronously the wait ops ``split_remote`` would."""

from __future__ import annotations

import torch.futures
import torch.fx
from torch.fx import Node

from distopt.passes.core.pass_base import PassContext, PassResult, PassSpec
from distopt.remote import registry, rpc_calls
from distopt.remote.ops import remote_ops
from distopt.remote.registry import RemoteCallSpec
from distopt.remote.wait import source_line
from distopt.text import plural

_WAIT_METHODS = {id(registry.wait_future): "wait", id(rpc_calls.wait_rref): "to_here"}
"""The method a user calls on an issue's result to wait for it, by the spec's ``wait``."""


def _wait_method(spec: RemoteCallSpec) -> str | None:
    return _WAIT_METHODS.get(id(spec.wait))


def pair_user_waits(gm: torch.fx.GraphModule, ctx: PassContext) -> PassResult:
    """Turn the waits users write on their own async remote calls into the spec's wait op.

    ``fut.wait()`` on ``rpc.rpc_async``/``rref.rpc_async().m()``/``remote_module.forward_async``,
    ``rref.to_here()`` on ``rpc.remote``/``rref.remote().m()``, and ``torch.futures.wait_all``
    over such futures, and a call of the spec's own wait function on the issue (Ray's
    ``ray.get(handle.lookup.remote(ids))``, see :mod:`distopt.remote.ray_calls`): the issue stays
    where it is (it is never wrapped again), and the scheduling passes can now hoist it and sink
    its waits like those ``split_remote`` makes.

    Before::

        rpc_async = torch.distributed.rpc.api.rpc_async('ps', lookup, args = (ids,))
        fc = self.fc(x)
        wait = rpc_async.wait()

    After::

        rpc_async = torch.distributed.rpc.api.rpc_async('ps', lookup, args = (ids,))
        fc = self.fc(x)
        wait = distopt_remote_wait_wait_rpc_sync(rpc_async, 'model.py:9: fut = rpc.rpc_async(...)')

    With Ray, before::

        ray_remote = distopt_remote_ray_calls_ray_remote(_distopt_const_actor_handle_0, 'lookup', (getitem,), {}, {})
        tower_0 = getattr(self.tower, "0")(dense)
        get = ray__private_worker_get(ray_remote)

    After::

        ray_remote = distopt_remote_ray_calls_ray_remote(_distopt_const_actor_handle_0, 'lookup', (getitem,), {}, {})
        tower_0 = getattr(self.tower, "0")(dense)
        get = distopt_remote_wait_wait_ray_call(ray_remote, 'model.py:14: e0 = ray.get(self.emb0.lookup.remote(ids[:, 0]))')
    """
    graph = gm.graph
    paired = 0
    # Wait functions users call themselves, which also take a list (Ray's ``ray.get``).
    list_waits = {
        id(spec.wait) for spec in registry.registered_specs() if _wait_method(spec) is None
    }
    for node, op in list(remote_ops(graph).items()):
        if node is not op.start or op.kind != "issue":
            continue
        method = _wait_method(op.spec)
        where = source_line(node)
        for user in list(node.users):
            if user.args != (node,) or user.kwargs:
                continue
            # ``fut.wait()``, or the spec's wait function itself (``ray.get(ref)``).
            by_method = method is not None and user.op == "call_method" and user.target == method
            by_function = user.op == "call_function" and user.target is op.spec.wait
            if by_method or by_function:
                _replace(graph, user, op.spec.wait_op, (node, where))
                paired += 1
    for node in list(graph.nodes):
        if node.op != "call_function" or len(node.args) != 1 or node.kwargs:
            continue
        if node.target is torch.futures.wait_all:
            paired += _pair_wait_all(graph, node)
        elif id(node.target) in list_waits:  # ray.get([ref0, ref1])
            paired += _pair_wait_all(graph, node, by=node.target)
    return PassResult(
        modified=paired > 0,
        detail=f"paired {plural(paired, 'user-written wait')} with their issues",
    )


def _replace(graph: torch.fx.Graph, old: Node, target: object, args: tuple[object, ...]) -> Node:
    with graph.inserting_before(old):
        new = graph.call_function(target, args)  # type: ignore[arg-type]
    new.meta.update(old.meta)
    old.replace_all_uses_with(new)
    graph.erase_node(old)
    return new


def _pair_wait_all(graph: torch.fx.Graph, node: Node, by: object = None) -> int:
    """``torch.futures.wait_all([f0, f1])`` → ``[wait(f0), wait(f1)]`` when every future is an
    issue whose spec waits with ``fut.wait()``; with ``by``, ``by([f0, f1])`` when every future
    is an issue whose spec's wait is ``by`` (``ray.get([ref0, ref1])``)."""
    futures = node.args[0] if node.args else None
    if not isinstance(futures, (list, tuple)) or not futures:
        return 0
    ops = remote_ops(graph)
    specs = []
    for fut in futures:
        op = ops.get(fut) if isinstance(fut, Node) else None
        if op is None or op.start is not fut or op.kind != "issue":
            return 0
        if (op.spec.wait is not by) if by is not None else _wait_method(op.spec) != "wait":
            return 0
        specs.append(op.spec)
    waits = []
    with graph.inserting_before(node):
        for fut, spec in zip(futures, specs, strict=True):
            wait = graph.call_function(spec.wait_op, (fut, source_line(fut)))
            wait.meta.update(node.meta)
            waits.append(wait)
        gathered = graph.call_function(list, (tuple(waits),))
    node.replace_all_uses_with(gathered)
    graph.erase_node(node)
    return len(waits)


PASS = PassSpec(name="pair_user_waits", fn=pair_user_waits, before=("hoist_issue", "sink_wait"))
"""This module's pass, listed with the other built-ins in :mod:`distopt.passes`."""
