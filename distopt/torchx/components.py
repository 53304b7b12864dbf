"""TorchX components for distopt jobs: ``ps_job`` (parameter server + trainers) and ``spmd``
(trainers only, DDP or FSDP as the config's ``parallel`` key says: one component for both, as
TorchX's ``dist.ddp``).

Every component runs ``python -m distopt.train --config CONFIG [--set key=value ...]`` and tells
the process where it stands through the environment (the contract with ``distopt.train``):

==========================  ===================================================================
``DISTOPT_ROLE``            ``ps`` or ``trainer``
``DISTOPT_LAUNCH``          the component: ``ps`` or ``spmd``
``REPLICA_ID``              index of this replica within its role (TorchX ``macros.replica_id``)
``DISTOPT_NUM_PS``          parameter-server replicas (0 for ``spmd``)
``DISTOPT_NUM_TRAINERS``    trainer replicas (``spmd``: torchrun's ``WORLD_SIZE`` instead)
``RANK``, ``WORLD_SIZE``    RPC rank and world size: servers first (``RANK = REPLICA_ID``), then
                            trainers (``RANK = DISTOPT_NUM_PS + REPLICA_ID``); torchrun's for
                            ``spmd``; with ``ps.backend: ray`` the trainers alone
``MASTER_ADDR``             host of the first replica of the first role (``ps`` 0; trainer 0 with
                            ``ps.backend: ray``, where it hosts the trainers' gloo store at
                            ``MASTER_PORT``), from the scheduler's rank-0 variable;
                            ``127.0.0.1`` when it has none
``MASTER_PORT``             RPC rendezvous port on ``MASTER_ADDR`` (the TCPStore of RPC rank 0)
``DISTOPT_PS_ADDR``         ``MASTER_ADDR:MASTER_PORT``
``DISTOPT_DDP_PORT``        ``MASTER_PORT + 1``: rendezvous of the trainers' gloo group
                            (hosted on ``MASTER_ADDR``, i.e. by ``ps`` 0)
``DISTOPT_RUN_ID``          ``--run_id`` when given (``ps_job``), shared by every process
``GLOO_SOCKET_IFNAME``,     the ``--iface`` network interface; unset with ``auto`` (default), where
``TP_SOCKET_IFNAME``        each process takes the interface of its route toward ``MASTER_ADDR``:
                            loopback on one host, the cluster network across hosts
                            (:mod:`distopt.dist.netif`)
==========================  ===================================================================

Overrides (``--set a.b=1,c=x``) are passed on as ``--set a.b=1 --set c=x``; ``--output_dir DIR``
is ``--set output_dir=DIR``; list values keep their commas
(``--set optimize_config.passes=[a,b],steps=5``). The config file and the overrides are checked on
the submitting machine (:mod:`.component_checks`), merged and built as a
:class:`~distopt.training.config.JobConfig` when the module is ``distopt.train``, so an unknown key or a
wrong type fails before anything is scheduled.
"""

# TorchX derives each flag's parser from the annotation; it understands typing's List/Dict/Optional.
# ruff: noqa: UP006, UP007, UP035, UP045

import shlex
import sys
from typing import Any, Dict, List, Optional

import torchx.specs as specs

from distopt.dist.netif import AUTO
from distopt.torchx.component_checks import (
    ComponentArgError,
    check_port,
    check_positive,
    checked_config,
)
from distopt.training.config import JobConfig

TRAIN_MODULE = "distopt.train"


def ps_job(
    config: str,
    num_ps: int = 1,
    num_trainers: int = 2,
    set: Optional[List[str]] = None,  # noqa: A002 - the flag is `--set`, like distopt.train's
    output_dir: Optional[str] = None,
    name: str = "distopt-ps",
    run_id: Optional[str] = None,
    image: str = ".",
    cpu: int = 1,
    gpu: int = 0,
    memMB: int = 1024,
    h: Optional[str] = None,
    master_port: int = 29500,
    iface: str = "auto",
    module: str = TRAIN_MODULE,
    python: Optional[str] = None,
    env: Optional[Dict[str, str]] = None,
    max_retries: int = 0,
) -> specs.AppDef:
    """Parameter-server training job: a ``ps`` role and a ``trainer`` role (DDP among trainers).

    Servers hold the parameters and answer the trainers' RPCs; trainers also join one gloo
    process group so dense parameters can be averaged with DDP. With ``ps.backend: ray`` in the
    config the app has the trainer role only: trainer 0 creates num_ps server actors on the Ray
    cluster at ``ps.ray_address``, and MASTER_ADDR is trainer 0's host.

    Args:
        config: path of the job's YAML config, relative to the workspace (e.g. configs/jobs/ps.yaml)
        num_ps: number of parameter-server replicas (Ray actors with ps.backend: ray)
        num_trainers: number of trainer replicas
        set: config overrides as key=value pairs, comma-separated (e.g. steps=5,variant=optimized; lists keep their commas: passes=[a,b])
        output_dir: directory for QPS logs and checkpoints (same as --set output_dir=DIR)
        name: job name
        run_id: run id shared by every process (DISTOPT_RUN_ID; default: chosen by the job)
        image: working directory or container image (workspaces replace it)
        cpu: CPUs per replica
        gpu: GPUs per trainer replica (servers keep their tables in host memory and get none)
        memMB: memory per replica in MB
        h: a TorchX named resource for the trainers (e.g. gpu.small, aws_p4d.24xlarge); replaces cpu, gpu and memMB there
        master_port: RPC rendezvous port on the first server's host; the trainers' gloo group uses master_port + 1
        iface: network interface for gloo and TensorPipe on every host; 'auto': each process takes the one of its route toward MASTER_ADDR (lo on one host)
        module: python module to run (the training entry point)
        python: interpreter to run it with; default: the one running torchx (right for local_cwd and for clusters sharing this filesystem), pass python to use the job's PATH
        env: extra environment variables (e.g. LOGLEVEL=INFO,FOO=bar)
        max_retries: how many times the scheduler may retry a failed job

    Returns:
        the TorchX application
    """
    check_positive("--num_ps", num_ps)
    check_positive("--num_trainers", num_trainers)
    overrides, job = _checked(config, set, output_dir, module)
    server_resource = _resource(cpu, 0, memMB, None)
    trainer_resource = _resource(cpu, gpu, memMB, h)
    check_port("--master_port", master_port)
    # ps.backend: ray: trainer 0 creates num_ps server actors itself (distopt.roles.ray_roles).
    on_ray = job is not None and job.ps.backend == "ray"
    world_size = num_trainers if on_ray else num_ps + num_trainers
    common = {
        "DISTOPT_LAUNCH": "ps",
        "DISTOPT_NUM_PS": str(num_ps),
        "DISTOPT_NUM_TRAINERS": str(num_trainers),
        "WORLD_SIZE": str(world_size),
        "MASTER_PORT": str(master_port),
        "DISTOPT_DDP_PORT": str(master_port + 1),
        "REPLICA_ID": specs.macros.replica_id,
        **_iface_env(iface),
        **({"DISTOPT_RUN_ID": run_id} if run_id else {}),
        **(env or {}),
    }
    members = (
        [("trainer", num_trainers, 0, trainer_resource)]
        if on_ray
        else [
            ("ps", num_ps, 0, server_resource),
            ("trainer", num_trainers, num_ps, trainer_resource),
        ]
    )
    roles = []
    for role, replicas, rank_offset, resource in members:
        roles.append(
            specs.Role(
                name=role,
                image=image,
                entrypoint="bash",
                args=["-c", _shell(python, module, config, overrides, rank_offset=rank_offset)],
                num_replicas=replicas,
                resource=resource,
                env={**common, "DISTOPT_ROLE": role},
                max_retries=max_retries,
            )
        )
    return specs.AppDef(name=name, roles=roles)


def spmd(
    config: str,
    nnodes: int = 1,
    nproc_per_node: int = 2,
    set: Optional[List[str]] = None,  # noqa: A002
    output_dir: Optional[str] = None,
    name: str = "distopt-spmd",
    image: str = ".",
    cpu: int = 2,
    gpu: int = 0,
    memMB: int = 2048,
    h: Optional[str] = None,
    rdzv_port: int = 29500,
    iface: str = "auto",
    module: str = TRAIN_MODULE,
    python: Optional[str] = None,
    env: Optional[Dict[str, str]] = None,
    max_retries: int = 0,
) -> specs.AppDef:
    """Data-parallel training job, DDP or FSDP as the config's ``parallel`` key says, launched with
    torchrun on each node (one component for both, as TorchX's ``dist.ddp``).

    Args:
        config: path of the job's YAML config, relative to the workspace
        nnodes: number of nodes (replicas)
        nproc_per_node: trainer processes per node
        set: config overrides as key=value pairs, comma-separated
        output_dir: directory for QPS logs and checkpoints (same as --set output_dir=DIR)
        name: job name
        image: working directory or container image (workspaces replace it)
        cpu: CPUs per node
        gpu: GPUs per node (usually nproc_per_node: one per trainer, picked by LOCAL_RANK)
        memMB: memory per node in MB
        h: a TorchX named resource per node (e.g. gpu.small, aws_p4d.24xlarge); replaces cpu, gpu and memMB
        rdzv_port: torchrun rendezvous port on the first node (multi-node only)
        iface: network interface for gloo on every host; 'auto': each process takes the one of its route toward the first node (lo on one host)
        module: python module to run (the training entry point)
        python: interpreter to run it with; default: the one running torchx (right for local_cwd and for clusters sharing this filesystem), pass python to use the job's PATH
        env: extra environment variables (e.g. LOGLEVEL=INFO)
        max_retries: how many times the scheduler may retry a failed job

    Returns:
        the TorchX application
    """
    role = _torchrun_role(
        "spmd",
        config,
        nnodes,
        nproc_per_node,
        set,
        output_dir,
        image,
        _resource(cpu, gpu, memMB, h),
        rdzv_port,
        iface,
        module,
        python,
        env,
        max_retries,
    )
    return specs.AppDef(name=name, roles=[role])


def _torchrun_role(
    launch: str,
    config: str,
    nnodes: int,
    nproc_per_node: int,
    set_: Optional[List[str]],
    output_dir: Optional[str],
    image: str,
    resource: specs.Resource,
    rdzv_port: int,
    iface: str,
    module: str,
    python: Optional[str],
    env: Optional[Dict[str, str]],
    max_retries: int,
) -> specs.Role:
    """The one role of ``spmd``: torchrun starting the trainers on each node."""
    check_positive("--nnodes", nnodes)
    check_positive("--nproc_per_node", nproc_per_node)
    check_port("--rdzv_port", rdzv_port)
    overrides = _checked(config, set_, output_dir, module)[0]
    # One node: port 0 lets torchrun pick a free port. Several: the first node hosts the store.
    if nnodes == 1:
        endpoint = "127.0.0.1:0"
    else:
        endpoint = f'"${{{specs.macros.rank0_env}:-127.0.0.1}}":{rdzv_port}'
    torchrun = [
        python or sys.executable,
        "-m",
        "torch.distributed.run",
        "--rdzv_backend",
        "c10d",
        "--rdzv_id",
        specs.macros.app_id,
        "--nnodes",
        str(nnodes),
        "--nproc_per_node",
        str(nproc_per_node),
        "-m",
        module,
        "--config",
        config,
        *_set_args(overrides),
    ]
    # The endpoint needs shell expansion of the scheduler's rank-0 variable, so it is not quoted.
    script = " ".join([*map(shlex.quote, torchrun[:3]), "--rdzv_endpoint", endpoint])
    script += " " + " ".join(shlex.quote(arg) for arg in torchrun[3:])
    role_env = {
        "DISTOPT_ROLE": "trainer",
        "DISTOPT_LAUNCH": launch,
        "DISTOPT_NUM_PS": "0",
        "REPLICA_ID": specs.macros.replica_id,
        **_iface_env(iface),
        **(env or {}),
    }
    return specs.Role(
        name="trainer",
        image=image,
        entrypoint="bash",
        args=["-c", f"{_omp_default(nproc_per_node)}exec {script}"],
        num_replicas=nnodes,
        resource=resource,
        env=role_env,
        max_retries=max_retries,
    )


def _omp_default(nproc_per_node: int) -> str:
    """torchrun sets ``OMP_NUM_THREADS=1`` when it starts several processes on a node without one,
    and prints a banner saying so: the same default, set before it (a value the environment has
    stays), keeps the replica's log quiet."""
    return 'export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"; ' if nproc_per_node > 1 else ""


def _shell(
    python: Optional[str], module: str, config: str, overrides: List[str], *, rank_offset: int
) -> str:
    """The ``bash -c`` script of a ``ps_job`` replica.

    Bash resolves the scheduler's rank-0 host variable (its name is ``macros.rank0_env``) and the
    rank arithmetic; a user-supplied ``MASTER_ADDR`` (``--env``) wins.
    """
    rank0 = specs.macros.rank0_env
    cmd = [python or sys.executable, "-m", module, "--config", config, *_set_args(overrides)]
    return (
        f'export MASTER_ADDR="${{MASTER_ADDR:-${{{rank0}:-127.0.0.1}}}}"; '
        f'export DISTOPT_PS_ADDR="$MASTER_ADDR:$MASTER_PORT"; '
        f"export RANK=$(({rank_offset} + {specs.macros.replica_id})); "
        f"exec {' '.join(shlex.quote(arg) for arg in cmd)}"
    )


def _set_args(overrides: List[str]) -> List[str]:
    return [arg for item in overrides for arg in ("--set", item)]


def _checked(
    config: str, items: Optional[List[str]], output_dir: Optional[str], module: str
) -> tuple[List[str], Optional[JobConfig]]:
    """The overrides to pass on and the merged job config (``None`` for another ``--module``)."""
    # The config's schema is distopt.train's; another --module reads its own kind of config.
    schema: Optional[type[Any]] = JobConfig if module == TRAIN_MODULE else None
    return checked_config(config, items, output_dir, schema=schema)


def _resource(cpu: int, gpu: int, memMB: int, h: Optional[str]) -> specs.Resource:
    check_positive("--cpu", cpu)
    check_positive("--memMB", memMB)
    if gpu < 0:
        raise ComponentArgError(f"--gpu: expected an integer >= 0, got {gpu}")
    if h is None:
        return specs.Resource(cpu=cpu, gpu=gpu, memMB=memMB)
    try:
        return specs.resource(h=h)
    except KeyError as err:
        raise ComponentArgError(f"-h: {err.args[0]}") from None


def _iface_env(iface: str) -> Dict[str, str]:
    """``auto`` (or ``''``) sets nothing: each process picks its own (:mod:`distopt.dist.netif`)."""
    if iface in ("", AUTO):
        return {}
    return {"GLOO_SOCKET_IFNAME": iface, "TP_SOCKET_IFNAME": iface}
