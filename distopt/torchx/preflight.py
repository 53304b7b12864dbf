"""What ``distopt launch`` checks about a job's own code before anything is scheduled.

A job names two factories (the config's ``model`` and ``data.source``) that every process runs.
This module runs them once here and checks what would otherwise fail in a replica log:

* **the model builds** (on the meta device when it can: no memory): a factory that raises is one
  line naming it and the user's source line;
* **the first batch**: the data factory's dataset through its ``collate_fn`` (the job's own loader,
  without workers) gives a :class:`~distopt.data.Batch` whose ``inputs`` fit ``model.forward``;
* **remote calls and where they go** (:func:`check_remote_calls`);
* **row caches** (``ps.cache``): each of a table the model has and its forward fetches, each and
  all together fitting in this host's memory (:func:`check_caches`);
* **imports in the replicas**: the directories the factories' modules were imported from here
  go on the replicas' ``PYTHONPATH`` (:func:`import_roots`), so a package outside the working
  directory imports there too, in trainers and in servers (which import the functions the
  trainers send them by module name).

The contract for remote calls, which the checks enforce:

* a model whose forward calls through the RPC group (``rpc.rpc_sync``/``rpc_async``/
  ``rpc.remote``, RRefs, ``RemoteModule``, helpers wrapping them, ``distopt.ps.fetch``) has a
  ``ps_tables()`` method: the job starts ``num_ps`` parameter servers (default 1) named ``ps0,
  ps1, ...``, trainers are ``trainer0, trainer1, ...`` in the same RPC group. ``ps_tables()``
  returns the :class:`~distopt.ps.TableSpec` tables distopt keeps on the servers, or ``[]`` when
  the model's own functions keep its state there. (Calls to the user's own Ray actors need no
  servers of the job);
* the functions a model sends over RPC run on the servers, which import them by qualified name:
  module-level functions of an importable module (not ``__main__``, not nested in a function);
* remote calls go to a process of the job (``ps0`` .. ``ps{num_ps-1}``, ``trainer0`` ..);
* the ``distopt.ps`` tables the forward fetches are tables ``ps_tables()`` declares
  (:func:`check_tables_read`);
* a job with ``ps.backend: ray`` has no RPC group: its model reaches the servers through
  ``distopt.ps`` only.
"""

from __future__ import annotations

import dataclasses
import inspect
import os
import sys
import sysconfig
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed.rpc as rpc
from torch import nn

import distopt.ps as ps
from distopt import models
from distopt.capture.frontend import symbolic_capture
from distopt.config import CaptureConfig, from_dict
from distopt.data import Batch, DataSource, to_batch
from distopt.errors import ConfigError, DistoptError
from distopt.ps.client import cache
from distopt.remote import registry
from distopt.remote.graph_args import concrete_args
from distopt.remote.helpers import declare_helpers, is_rpc_helper
from distopt.remote.intercept import namespaces_of
from distopt.remote.local import has_remote_modules
from distopt.remote.registry import effect_of, resource_of
from distopt.training.config import JobConfig
from distopt.where import describe_failure, frames_of

_RPC_CALLS = ("rpc_sync", "rpc_async", "remote")
"""``torch.distributed.rpc`` functions whose first argument names the process they go to."""


def build_model(config: JobConfig) -> nn.Module:
    """The job's model, on the meta device (no memory, no initialization) when its factory
    builds there, else on the CPU; a factory that fails is one line naming it."""
    try:
        with torch.device("meta"):
            return models.build(config.model_name, **config.model_kwargs)
    except DistoptError:
        raise
    except Exception:  # a factory that needs real tensors to build: try it as the trainers will
        pass
    try:
        return models.build(config.model_name, **config.model_kwargs)
    except DistoptError:
        raise
    except Exception as err:
        hint = ""
        if "RPC has not been initialized" in str(err):
            hint = (
                "; create remote objects (RRefs, RemoteModules) on first use in forward: the "
                "factory also runs where there is no RPC group (here, and in each server "
                "asking the model for its ps_tables())"
            )
        raise ConfigError(
            f"model: {config.model_name} failed: {describe_failure(err)}{hint}"
        ) from None


def check_first_batch(
    source: DataSource, model: nn.Module, config: JobConfig, *, num_trainers: int
) -> Batch:
    """The first training batch of trainer 0, through the job's loader (no worker processes)
    and collate function; its inputs must fit ``model.forward``. Returns the batch."""
    what = (
        config.data.source if ":" in config.data.source else f"data.source {config.data.source!r}"
    )
    here = dataclasses.replace(source, config=dataclasses.replace(source.config, num_workers=0))
    try:
        loader = here.train_loader(
            rank=0, world_size=num_trainers, batch_size=config.batch_size, seed=config.seed
        )
        first = next(iter(loader.batches(0)))
    except DistoptError:
        raise
    except StopIteration:
        raise ConfigError(
            f"data: {what} gave no batch of {config.batch_size} samples for trainer 0 "
            f"of {num_trainers}"
        ) from None
    except Exception as err:
        raise ConfigError(
            f"data: the first batch of {what} failed: {describe_failure(err)}"
        ) from None
    batch = to_batch(first)
    try:
        signature = inspect.signature(model.forward)
        signature.bind(*batch.inputs)
    except TypeError as err:
        targets = "no targets" if batch.targets is None else "targets"
        raise ConfigError(
            f"data: a batch of {what} has {len(batch.inputs)} inputs and {targets}, which "
            f"{type(model).__name__}.forward{signature} does not take ({err}): "
            f"{_batch_hint(batch)}"
        ) from None
    except ValueError:  # no signature to check
        pass
    return batch


def _batch_hint(batch: Batch) -> str:
    """What to change in the collate function, from the batch it made (only a Batch the
    collate function returned has targets; a dict is taken whole as the only input)."""
    if len(batch.inputs) == 1 and isinstance(batch.inputs[0], dict):
        keys = ", ".join(repr(k) for k in batch.inputs[0])
        return (
            f"the batch is a dict ({keys}), taken as one input: make the collate function return "
            "distopt.data.Batch(inputs=(...), targets=...)"
        )
    if batch.targets is not None:
        return "make the Batch's inputs the forward's arguments, in its order"
    return (
        "make the collate function return distopt.data.Batch(inputs=(...), targets=...); a tuple "
        "or list is taken for the inputs alone"
    )


@dataclasses.dataclass(frozen=True, slots=True)
class RemoteCall:
    """One remote call a model's forward makes, as traced."""

    name: str
    """The registered call: ``torch.distributed.rpc.api.rpc_sync``, ``distopt.ps.fetch``, ..."""
    over_rpc: bool
    """Whether it goes through the job's RPC group (``torch.distributed.rpc``, RRefs,
    ``RemoteModule``, RPC helpers, ``distopt.ps``), which only a job with servers forms; not
    Ray's calls or a client function the user registered for a transport of their own."""
    to: str | None
    """The process an RPC goes to, by name (``None``: not an RPC, or not a plain name)."""
    function: Any
    """The function an RPC sends (``None`` when not an RPC)."""
    reads: Any = None
    """The resource a read reads, when its arguments are known (``("distopt.ps", table)`` for a
    fetch); ``None`` for writes and reads of graph values."""
    where: str = "?"
    """``file:line`` of the user's call."""

    def describe(self) -> str:
        short = self.name.rsplit(".", 1)[-1]
        sent = f", {_qualified(self.function)}" if self.function is not None else ""
        to = f"{self.to!r}" if self.to is not None else ""
        return f"{short}({to}{sent}) at {self.where}"


def remote_calls(model: nn.Module, config: JobConfig) -> list[RemoteCall] | None:
    """The remote calls ``model``'s forward makes, traced without running any (``None`` when the
    model does not trace: only whether its code can reach one is known then)."""
    capture = from_dict(
        CaptureConfig,
        dict(config.optimize_config.get("capture") or {}),
        prefix="optimize_config.capture",
    )
    try:
        gm = symbolic_capture(model, capture)
    except Exception:
        return None
    found = []
    for node in gm.graph.nodes:
        spec = registry.lookup(node.target) if node.op == "call_function" else None
        if spec is None:
            continue
        to, function = None, None
        short = spec.name.rsplit(".", 1)[-1]
        if short in _RPC_CALLS and spec.name.startswith("torch.distributed.rpc"):
            args, kwargs = concrete_args(node)
            to = args[0] if args else kwargs.get("to")
            function = args[1] if len(args) > 1 else kwargs.get("func")
            to = to if isinstance(to, str) else getattr(to, "name", None)
        frames = frames_of(node.stack_trace or "")
        where = f"{frames[-1].filename}:{frames[-1].lineno}" if frames else "?"
        over_rpc = spec.fn.__module__.startswith(_RPC_MODULES) or is_rpc_helper(spec.fn)
        found.append(
            RemoteCall(
                name=spec.name,
                over_rpc=over_rpc,
                to=to,
                function=function,
                reads=_read_resource(spec, node),
                where=where,
            )
        )
    return found


def _read_resource(spec: Any, node: torch.fx.Node) -> Any:
    """The resource the call at ``node`` reads (see :attr:`RemoteCall.reads`)."""
    args, kwargs = concrete_args(node)
    try:
        return resource_of(spec, args, kwargs) if effect_of(spec, args, kwargs) == "read" else None
    except Exception:  # arguments the registry cannot read (graph values)
        return None


def check_caches(model: nn.Module, config: JobConfig, calls: list[RemoteCall] | None) -> None:
    """``ps.cache`` against the model's tables, the tables its forward fetches (when its graph
    shows ``distopt.ps`` fetches) and this host's memory: a one-line error naming the cache."""
    if not config.ps.cache:
        return
    ps_tables = getattr(model, "ps_tables", None)
    tables = tuple(ps_tables()) if callable(ps_tables) else ()
    reads = set(tables_read(calls))
    cache.check_caches(config.ps.cache, tables, reads=reads or None)


_RPC_MODULES = ("torch.distributed.rpc.api", "distopt.remote.rpc_calls", "distopt.ps.client")
"""Modules (and packages) of the remote calls that need the job's RPC group."""


def reaches_rpc(model: nn.Module) -> bool:
    """Whether code that runs ``model`` can reach the RPC group (for a model that does not trace):
    ``torch.distributed.rpc`` or ``distopt.ps`` in its modules' globals, a ``RemoteModule``, or an
    RPC helper (see :func:`distopt.remote.intercept.makes_remote_calls`, which counts Ray too)."""
    if has_remote_modules(model):
        return True
    namespaces = namespaces_of(model, with_leaf_modules=False)
    if declare_helpers(namespaces):
        return True
    apis = {
        id(rpc),
        id(ps),
        id(rpc.rpc_sync),
        id(rpc.rpc_async),
        id(rpc.remote),
        id(ps.fetch),
        id(ps.fetch_async),
    }
    return any(id(value) in apis for namespace in namespaces for value in list(namespace.values()))


def check_remote_calls(
    model: nn.Module,
    config: JobConfig,
    calls: list[RemoteCall] | None,
    *,
    num_ps: int,
    num_trainers: int,
) -> None:
    """The remote-call contract of the module docstring, for the job's model as built and the
    ``calls`` :func:`remote_calls` found in it."""
    owner = type(model).__name__
    has_tables = callable(getattr(model, "ps_tables", None))
    over_rpc = [c for c in calls or () if c.over_rpc]
    reaches = bool(over_rpc) if calls is not None else reaches_rpc(model)
    if num_ps and not has_tables:
        raise ConfigError(
            f"num_ps: {num_ps} parameter servers, but {owner} ({config.model_name}) has no "
            "ps_tables() method, which each server calls to learn its tables: add one (return [] "
            "when your own functions keep the tables on the servers)"
        )
    if reaches and not num_ps and has_tables:
        what = over_rpc[0].describe() if over_rpc else "its code calls torch.distributed.rpc"
        raise ConfigError(
            f"num_ps: 0 parameter servers, but {owner}.forward makes remote calls ({what}), which "
            "need the job's RPC group and its servers ps0, ps1, ...: launch with --num-ps 1 or "
            "more (or leave --num-ps out: a model with ps_tables() gets 1)"
        )
    if reaches and not num_ps:
        what = over_rpc[0].describe() if over_rpc else "its code calls torch.distributed.rpc"
        raise ConfigError(
            f"model: {owner}.forward makes remote calls ({what}), but {owner} has no ps_tables() "
            "method, so the job would start no parameter server and run as plain data parallel: "
            f"add ps_tables() to {owner} (return [] when your own functions keep the tables on "
            "the servers, ps0, ps1, ...)"
        )
    rpcs = [c for c in over_rpc if c.function is not None or c.to is not None]
    if rpcs and config.ps.backend == "ray":
        raise ConfigError(
            f"ps.backend: 'ray' jobs have no RPC group, but {owner}.forward calls "
            f"{rpcs[0].describe()}: use ps.backend: rpc, or distopt.ps tables"
        )
    if has_tables and num_ps:
        check_tables_read(model, calls)
    workers = [f"ps{i}" for i in range(num_ps)] + [f"trainer{j}" for j in range(num_trainers)]
    for call in rpcs:
        if call.to is not None and call.to not in workers:
            raise ConfigError(
                f"model: {owner}.forward calls {call.describe()}, but {call.to!r} is no process "
                f"of this job (its RPC workers are {', '.join(workers)})"
            )
        reason = _not_importable(call.function)
        if reason:
            raise ConfigError(
                f"model: {owner}.forward sends {_qualified(call.function)} ({call.where}) to run on "
                f"{call.to or 'a server'}, which imports it by name, but it {reason}: define it at "
                "the top level of a module of your package"
            )


def tables_read(calls: Iterable[RemoteCall] | None) -> dict[str, RemoteCall]:
    """The ``distopt.ps`` tables ``calls`` fetch, each with its first fetch."""
    found: dict[str, RemoteCall] = {}
    for call in calls or ():
        if isinstance(call.reads, tuple) and len(call.reads) == 2 and call.reads[0] == "distopt.ps":
            found.setdefault(call.reads[1], call)
    return found


def check_tables_read(model: nn.Module, calls: list[RemoteCall] | None) -> None:
    """Every ``distopt.ps`` table the forward fetches is one ``model.ps_tables()`` declares (the
    servers hold only those: an undeclared one fails the first step, in a replica's log)."""
    read = tables_read(calls)
    if not read:
        return
    owner = type(model).__name__
    ps_tables: Any = getattr(model, "ps_tables", None)
    try:
        declared = {spec.name for spec in ps_tables()}
    except Exception as err:
        if any(t.is_meta for t in (*model.parameters(), *model.buffers())):
            return  # built on the meta device here; the servers call it on a real model
        raise ConfigError(f"model: {owner}.ps_tables() failed: {describe_failure(err)}") from None
    for table, call in read.items():
        if table not in declared:
            known = ", ".join(repr(name) for name in sorted(declared)) or "none"
            raise ConfigError(
                f"model: {owner}.forward fetches table {table!r} at {call.where}, but "
                f"{owner}.ps_tables() does not declare it (declared: {known}), so no server "
                f"holds it: add distopt.ps.TableSpec(name={table!r}, ...) to ps_tables()"
            )


def _qualified(fn: Any) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


def _not_importable(fn: Any) -> str | None:
    """Why a server could not import ``fn`` by its qualified name (``None``: it can)."""
    if fn is None or not callable(fn):
        return None
    module, qualname = getattr(fn, "__module__", None), getattr(fn, "__qualname__", "")
    if module == "__main__":
        return "is defined in the script being run (__main__), which the server does not run"
    if "<locals>" in qualname or "<lambda>" in qualname:
        return "is defined inside a function (or is a lambda)"
    return None


def import_roots(modules: Iterable[str]) -> list[str]:
    """The ``sys.path`` entries from which these modules were imported here, other than the
    working directory (where replicas start), the standard library and installed packages."""
    skip = {os.path.abspath(os.getcwd())}
    skip |= {
        os.path.abspath(p)
        for key in ("stdlib", "platstdlib", "purelib", "platlib")
        if (p := sysconfig.get_path(key))
    }
    roots: list[str] = []
    for name in modules:
        top = sys.modules.get(name.split(".")[0])
        if top is None:
            continue
        path = getattr(top, "__file__", None)
        if path is None:  # a namespace package
            locations = list(getattr(top, "__path__", []))
            root = os.path.dirname(os.path.abspath(locations[0])) if locations else None
        elif os.path.basename(path) == "__init__.py":
            root = os.path.dirname(os.path.dirname(os.path.abspath(path)))
        else:
            root = os.path.dirname(os.path.abspath(path))
        if root is None or root in skip or "site-packages" in root or root in roots:
            continue
        roots.append(root)
    return roots


def user_modules(
    model: nn.Module, config: JobConfig, calls: Iterable[RemoteCall] = ()
) -> list[str]:
    """The modules of the job's own code: its factories, its model's classes, the functions it
    sends to the servers."""
    names = [
        spec.partition(":")[0] for spec in (config.model_name, config.data.source) if ":" in spec
    ]
    names += [cls.__module__ for cls in type(model).__mro__ if cls.__module__ != "builtins"]
    names += [
        call.function.__module__ for call in calls if getattr(call.function, "__module__", None)
    ]
    return [n for n in dict.fromkeys(names) if not n.startswith(("torch", "distopt"))]


__all__ = [
    "RemoteCall",
    "build_model",
    "check_first_batch",
    "check_remote_calls",
    "check_tables_read",
    "import_roots",
    "remote_calls",
    "tables_read",
    "user_modules",
]
