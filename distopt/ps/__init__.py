"""Parameter servers: a real parameter server on RPC or Ray, and the calls model code makes.

Servers hold named ``[num_rows, dim]`` tables sharded by ``row % n``; trainers call
:func:`fetch`/:func:`push` (blocking, as users write them) or their ``*_async`` forms;
:func:`push_gradients` pushes the gradients of every row fetched in the step; ``ServerOptions.cache``
keeps hot rows with the trainer (:mod:`distopt.ps.client.cache`). Jobs are started
with :func:`running_servers` (or :func:`start_servers`/:func:`stop_servers`) + :func:`init_trainer`
and left with :func:`shutdown` (or :func:`abort`), or :func:`local_job` in one process;
:func:`recover` goes on after Ray restarted a server actor.

The package, by layer (``docs/ps_runtime.md`` has the design):

- ``client/``: what model code calls: fetch, push, wait, ordering, the step's fetched rows;
- ``server/``: one server: its shards and the operations it answers, declared once;
- ``transport/``: how a request reaches a server: RPC (TensorPipe) or Ray actors, both ends;
- ``cluster/``: a job's life: backends that start, join, leave, stop and recover it, and this
  process's session;
- ``spec.py``: the validated descriptions of tables and servers every layer shares.
"""

# registration declares fetch/push to distopt.remote (and imports the client first)
from distopt.ps.client import registration as registration  # noqa: F401
from distopt.ps.client.cache import FetchCounts
from distopt.ps.client.calls import (
    Route,
    fetch,
    fetch_async,
    fetch_many_async,
    flush,
    pin_rows,
    push,
    push_async,
    push_gradients,
    push_many_async,
    routes,
    set_device,
    take_fetch_counts,
    take_wait_time,
    wait,
)
from distopt.ps.client.context import FetchRecord, discard_step
from distopt.ps.client.embedding import RemoteEmbedding
from distopt.ps.client.futures import FetchFuture
from distopt.ps.client.registration import fetch_batched
from distopt.ps.cluster.admin import (
    load_servers,
    load_state_dict,
    save_servers,
    server_stats,
    set_latency_ms,
    state_dict,
)
from distopt.ps.cluster.job import PSJob
from distopt.ps.cluster.lifecycle import Recovery
from distopt.ps.cluster.session import (
    abort,
    init_trainer,
    local_job,
    recover,
    running_servers,
    servers_ready,
    shutdown,
    start_servers,
    stop_servers,
)
from distopt.ps.spec import CacheConfig, ServerOptions, TableSpec, server_name, trainer_name

# Bound for distopt.cli.cmd_explain, which reads ``distopt.ps.context.isolated_step``; issue 23's second
# phase points it at distopt.ps.client.context and drops this name.
from distopt.ps.client import context as context  # noqa: E402,F401  isort: skip

__all__ = [
    "CacheConfig",
    "FetchCounts",
    "FetchFuture",
    "FetchRecord",
    "PSJob",
    "Recovery",
    "RemoteEmbedding",
    "Route",
    "ServerOptions",
    "TableSpec",
    "abort",
    "discard_step",
    "fetch",
    "fetch_async",
    "fetch_batched",
    "fetch_many_async",
    "flush",
    "init_trainer",
    "load_servers",
    "load_state_dict",
    "local_job",
    "pin_rows",
    "push",
    "push_async",
    "push_many_async",
    "push_gradients",
    "recover",
    "routes",
    "running_servers",
    "save_servers",
    "server_name",
    "server_stats",
    "servers_ready",
    "set_latency_ms",
    "set_device",
    "shutdown",
    "start_servers",
    "state_dict",
    "stop_servers",
    "take_fetch_counts",
    "take_wait_time",
    "trainer_name",
    "wait",
]
