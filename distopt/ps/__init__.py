"""A real parameter server on ``torch.distributed.rpc`` and the client calls model code makes.

Servers (``distopt.ps.server``) hold named ``[num_rows, dim]`` tables sharded by ``row % n``;
trainers call :func:`fetch`/:func:`push` (blocking, as users write them) or their ``*_async``
forms; :func:`push_gradients` pushes the gradients of every row fetched in the step. Jobs are
started with :func:`running_servers` (or :func:`start_servers`/:func:`stop_servers`) +
:func:`init_trainer` and left with :func:`shutdown` (or :func:`abort`), or :func:`local_job` in one
process; see ``distopt.ps.launch`` for who hosts the job's stores and how servers shut down, and
:func:`recover` (``distopt.ps.ray_recovery``) for going on after Ray restarted a server actor.
See ``distopt.ps.client`` for ordering and error semantics.
"""

# registration declares fetch/push to distopt.remote (and imports the client first)
from distopt.ps import registration as registration  # noqa: F401
from distopt.ps.client import (
    FetchFuture,
    Route,
    fetch,
    fetch_async,
    fetch_many_async,
    flush,
    push,
    push_async,
    push_gradients,
    push_many_async,
    routes,
    set_device,
    take_wait_time,
    wait,
)
from distopt.ps.context import FetchRecord, discard_step
from distopt.ps.embedding import RemoteEmbedding
from distopt.ps.launch import (
    PSJob,
    abort,
    init_trainer,
    local_job,
    running_servers,
    shutdown,
    start_servers,
    stop_servers,
)
from distopt.ps.ray_recovery import Recovery, recover, servers_ready
from distopt.ps.registration import fetch_batched
from distopt.ps.servers import (
    load_servers,
    load_state_dict,
    save_servers,
    server_stats,
    set_latency_ms,
    state_dict,
)
from distopt.ps.spec import ServerOptions, TableSpec, server_name, trainer_name

__all__ = [
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
    "take_wait_time",
    "trainer_name",
    "wait",
]
