"""One parameter-server process of an RPC job: joins the job's RPC group and serves until done.

Run by :class:`~distopt.ps.cluster.rpc_backend.RpcBackend` as ``python -m distopt.ps.cluster.rpc_main
CONFIG_JSON`` (:func:`config` builds it), and by ``distopt.train``'s ``ps`` role
(:mod:`distopt.roles.ps_roles`), both through :func:`serve`. Server ``i`` joins the RPC group as ``ps{i}``
with rank ``num_trainers + i``; trainer ``j`` has rank ``j``. The config's store plan
(:class:`distopt.dist.rendezvous.StorePlan`) says who hosts the job's stores: the launcher for
``start_servers``, ``ps0`` for ``distopt.train``; a hosting server keeps them until every trainer
has left. The process exits with status 0 once every trainer has said it is done, with 1 when a
trainer aborts the job or falls silent, with 3 when the launcher that started it dies.

The requests themselves are answered by the RPC handlers (:mod:`distopt.ps.transport.rpc`) with
the :class:`~distopt.ps.server.parameter_server.ParameterServer` this process serves.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import threading
import time
from typing import Any

import torch

from distopt.dist import rendezvous
from distopt.dist.rendezvous import StorePlan
from distopt.ps.server.parameter_server import ParameterServer
from distopt.ps.spec import ServerOptions, TableSpec, server_name, trainer_name
from distopt.ps.transport.rpc import serve_here


def config(
    *,
    index: int,
    num_trainers: int,
    plan: StorePlan,
    options: ServerOptions,
    tables: tuple[TableSpec, ...],
    launcher_pid: int | None = None,
) -> dict[str, Any]:
    """What server ``index`` of a job needs, as JSON-ready data (the process's argument)."""
    return {
        "index": index,
        "rank": num_trainers + index,  # RPC ranks: trainers first, then servers
        "world_size": options.num_servers + num_trainers,
        "plan": dataclasses.asdict(plan),
        "launcher_pid": launcher_pid,
        # The trainers' row caches are nothing to a server.
        "options": dataclasses.asdict(dataclasses.replace(options, cache={})),
        "tables": [dataclasses.asdict(t) for t in tables],
    }


def serve(config: dict[str, Any]) -> None:
    """Join the RPC group as a parameter server and serve until every trainer is done."""
    options = ServerOptions(**config["options"])
    tables = tuple(TableSpec.from_dict(t) for t in config["tables"])
    plan = StorePlan(**config["plan"])
    index = int(config["index"])
    name = server_name(index)
    # Handlers are small index_select/index_add calls: one intra-op thread each avoids
    # oversubscribing the cores that trainers and other servers share.
    torch.set_num_threads(1)
    _exit_with_launcher(config.get("launcher_pid"))
    server = ParameterServer(index, tables, options)
    num_trainers = int(config["world_size"]) - options.num_servers
    server.expect_trainers(num_trainers)
    serve_here(server)
    trainers = [trainer_name(j) for j in range(num_trainers)]
    with rendezvous.host_stores(plan, me=name, timeout_s=options.join_timeout_s) as hosted:
        rendezvous.meet(plan, me=name, others=trainers, timeout_s=options.join_timeout_s)
        rendezvous.init_rpc(
            plan,
            name=name,
            rank=int(config["rank"]),
            world_size=int(config["world_size"]),
            transport=options,
            timeout_s=options.join_timeout_s,
        )
        server.start_listening()
        _watch_trainers(server, options.trainer_timeout_s)
        # Serve until every trainer said it is done, then leave together with them.
        server.stop.wait()
        rendezvous.leave_rpc(me=name, graceful=True)
        # Trainers mark themselves left in the RPC store after leaving the group: a hosting server
        # keeps the stores up until they have (bounded, in case one died after saying it was done).
        late = hosted.wait_until_left(trainers, timeout_s=options.rpc_timeout_s)
    serve_here(None)
    if late:
        print(
            f"distopt.ps.server: {name}: closed the job's stores before {', '.join(late)} left "
            f"(waited ps.rpc_timeout_s={options.rpc_timeout_s:g})",
            file=sys.stderr,
            flush=True,
        )


def _watch_trainers(server: ParameterServer, timeout_s: float) -> None:
    """Exit the process with status 1 when a trainer that has not finished goes silent.

    A killed trainer never says it is done, so without this the servers would wait for it forever.
    """

    def watch() -> None:
        while not server.stop.wait(min(1.0, timeout_s / 4)):
            silent = server.silent_trainers(timeout_s)
            if silent:
                name, quiet = silent[0]
                print(
                    f"distopt.ps.server: error: {server.name}: {name} sent nothing for {quiet:.1f} s "
                    f"(ps.trainer_timeout_s={timeout_s:g}): killed or stuck; exiting",
                    file=sys.stderr,
                    flush=True,
                )
                os._exit(1)

    threading.Thread(target=watch, name="distopt-ps-trainer-watch", daemon=True).start()


def _exit_with_launcher(launcher_pid: int | None) -> None:
    """Exit when the launching process dies (crash, SIGKILL): never leave an orphan server behind."""
    if launcher_pid is None:
        return

    def watch() -> None:
        while os.getppid() == launcher_pid:
            time.sleep(0.5)
        os._exit(3)

    threading.Thread(target=watch, name="distopt-ps-launcher-watch", daemon=True).start()
