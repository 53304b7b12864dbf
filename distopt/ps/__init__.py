"""A real parameter server on ``torch.distributed.rpc`` and the client calls model code makes.

Servers (``distopt.ps.server``) hold named ``[num_rows, dim]`` tables sharded by ``row % n``;
trainers call :func:`fetch`/:func:`push` (blocking, as users write them) or their ``*_async``
forms; :func:`push_gradients` pushes the gradients of every row fetched in the step. Jobs are
started with :func:`start_servers` + :func:`init_trainer`, or :func:`local_job` in one process.
See ``distopt.ps.client`` for ordering and error semantics.
"""

# registration declares fetch/push to distopt.remote (and imports the client first)
from distopt.ps import registration as registration  # noqa: F401
from distopt.ps.client import (
    FetchFuture,
    Route,
    fetch,
    fetch_async,
    fetch_batched,
    fetch_many_async,
    flush,
    load_servers,
    load_state_dict,
    push,
    push_async,
    push_gradients,
    routes,
    save_servers,
    server_stats,
    state_dict,
    wait,
)
from distopt.ps.context import FetchRecord, discard_step
from distopt.ps.embedding import RemoteEmbedding
from distopt.ps.launch import PSJob, init_trainer, local_job, ps_job, shutdown, start_servers
from distopt.ps.spec import ServerOptions, TableSpec, server_name, trainer_name

__all__ = [
    "FetchFuture",
    "FetchRecord",
    "PSJob",
    "RemoteEmbedding",
    "Route",
    "ServerOptions",
    "TableSpec",
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
    "ps_job",
    "push",
    "push_async",
    "push_gradients",
    "routes",
    "save_servers",
    "server_name",
    "server_stats",
    "shutdown",
    "start_servers",
    "state_dict",
    "trainer_name",
    "wait",
]
