"""A TorchX scheduler for Ray built on Ray's job submission API, for TorchX releases without one.

TorchX removed its ``ray`` scheduler upstream (pytorch/torchx#1120). This scheduler is
``distopt_ray`` everywhere and ``ray`` where TorchX has none; :mod:`.schedulers` says how it
reaches TorchX without changing TorchX's own scheduler list.

**One Ray job per app.** The job's entrypoint is :mod:`distopt.torchx.ray_job_driver` (shipped
with the job), which reserves one placement group for every replica of every role and runs each
replica as a Ray actor. One job per role was the alternative; it was not taken because Ray would
schedule the roles independently (a parameter server could start and wait forever for trainers
that do not fit), the app's state would have to be merged from several jobs, and a cancel could
stop one role and miss another. With one job, Ray's job state is the app's state and
``ray job stop`` ends every replica.

The app id is ``HOST:PORT-SUBMISSION_ID`` (the dashboard address and the Ray submission id), so
``torchx status``, ``log`` and ``cancel`` find the cluster from the handle alone. Replicas' log
lines reach the job log as ``[role/replica] line``; :meth:`RayJobScheduler.log_iter` selects one
replica's. Role retries (``max_retries``) are not supported: a failing replica fails the app.

This module imports Ray's job submission client (Ray is optional: ``distopt[ray]``); nothing
imports it until a scheduler is made (:mod:`.schedulers`, ``plugins/torchx-ray``).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, TypedDict

from ray.job_submission import JobSubmissionClient
from torchx.schedulers.api import (
    DescribeAppResponse,
    ListAppResponse,
    Scheduler,
    Stream,
    filter_regex,
    split_lines,
)
from torchx.schedulers.ids import make_unique
from torchx.specs import (
    AppDef,
    AppDryRunInfo,
    AppState,
    ReplicaStatus,
    Role,
    RoleStatus,
    macros,
    runopts,
)

__all__ = [
    "RayDashboardError",
    "RayJobRequest",
    "RayJobScheduler",
    "ReplicaSpec",
    "create_ray_scheduler",
    "create_scheduler",
]

DEFAULT_DASHBOARD = "127.0.0.1:8265"
DRIVER = Path(__file__).with_name("ray_job_driver")  # a package: python -m ray_job_driver
RANK0_ENV = "TORCHX_RANK0_HOST"  # the driver's name for it too (ray_job_driver.__main__)
ROLES_KEY = "distopt.roles"  # job metadata: {role: replicas}; marks the jobs this scheduler made
_ADDRESS = re.compile(r"^(?:https?://)?([A-Za-z0-9.\-]+|\[[0-9a-fA-F:]+\]):(\d{1,5})/?$")
_APP_ID = re.compile(r"^(.+:\d+)-(.+)$")

_STATES = {  # Ray JobStatus values
    "PENDING": AppState.PENDING,
    "RUNNING": AppState.RUNNING,
    "SUCCEEDED": AppState.SUCCEEDED,
    "FAILED": AppState.FAILED,
    "STOPPED": AppState.CANCELLED,
}


def _state(status: Any) -> AppState:
    return _STATES[str(getattr(status, "value", status))]


class RayDashboardError(ConnectionError):
    """The Ray dashboard (job submission API) at an address could not be used."""


class RayJobOpts(TypedDict, total=False):
    dashboard_address: str
    working_dir: str | None
    requirements: str | None


@dataclass(frozen=True, slots=True)
class ReplicaSpec:
    """One replica as the driver runs it."""

    role: str
    replica_id: int
    command: list[str]
    env: dict[str, str]
    resources: dict[str, float]
    """A placement-group bundle: Ray's ``CPU``, ``GPU`` and ``memory`` (bytes)."""


@dataclass(frozen=True, slots=True)
class RayJobRequest:
    """What :meth:`RayJobScheduler.schedule` submits (``JobSubmissionClient.submit_job``)."""

    dashboard_address: str
    """``HOST:PORT`` of the dashboard."""
    submission_id: str
    entrypoint: str
    runtime_env: dict[str, Any]
    metadata: dict[str, str]
    replicas: list[ReplicaSpec] = field(default_factory=list)

    def __str__(self) -> str:
        body = {k: v for k, v in asdict(self).items() if k != "entrypoint"}
        return json.dumps(body, indent=2)


def dashboard_netloc(address: str) -> str:
    """``HOST:PORT`` of a dashboard address given as ``HOST:PORT`` or ``http(s)://HOST:PORT``."""
    match = _ADDRESS.match(address.strip())
    if match is None or not 0 < int(match.group(2)) < 65536:
        raise ValueError(
            f"dashboard_address={address!r} is not HOST:PORT or http://HOST:PORT "
            "(the Ray dashboard, e.g. 127.0.0.1:8265)"
        )
    return f"{match.group(1)}:{match.group(2)}"


def _client(netloc: str) -> Any:
    try:
        return JobSubmissionClient(f"http://{netloc}")
    except (ConnectionError, RuntimeError) as err:
        # Ray's own message spans lines and names the URL twice; one line is enough.
        reason = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise RayDashboardError(f"cannot reach the Ray dashboard at {netloc}: {reason}") from None


def _split_app_id(app_id: str) -> tuple[str, str]:
    match = _APP_ID.match(app_id)
    if match is None:
        raise ValueError(f"app id {app_id!r} is not HOST:PORT-SUBMISSION_ID")
    return match.group(1), match.group(2)


def _resources(role: Role) -> dict[str, float]:
    res = role.resource
    # A bundle may not be empty, and every replica is a process: at least one logical CPU.
    bundle: dict[str, float] = {"CPU": float(max(1, res.cpu))}
    if res.gpu > 0:
        bundle["GPU"] = float(res.gpu)
    if res.memMB > 0:
        bundle["memory"] = float(res.memMB * 1024 * 1024)
    return bundle


def _working_dir(app: AppDef, option: str | None) -> str | None:
    """The directory uploaded as the job's ``working_dir``: the option, else the roles' image.

    A Ray job has one working directory, so roles whose images are different directories cannot
    share a job; an image that is not a local directory (a container) uploads nothing.
    """
    if option:
        if not os.path.isdir(option):
            raise ValueError(f"working_dir={option!r} is not a directory")
        return os.path.abspath(option)
    dirs = {os.path.abspath(r.image) for r in app.roles if r.image and os.path.isdir(r.image)}
    if len(dirs) > 1:
        raise ValueError(
            f"roles' images are different directories {sorted(dirs)}; a Ray job has one "
            "working_dir: pass -cfg working_dir=DIR"
        )
    return dirs.pop() if dirs else None


class RayJobScheduler(Scheduler[RayJobOpts]):
    """TorchX scheduler submitting each app as one job to a Ray cluster's job submission API."""

    def __init__(self, session_name: str, backend: str = "distopt_ray") -> None:
        super().__init__(backend, session_name)

    def _run_opts(self) -> runopts:
        opts = runopts()
        opts.add(
            "dashboard_address",
            type_=str,
            default=DEFAULT_DASHBOARD,
            help="Ray dashboard / job submission address, HOST:PORT or http://HOST:PORT",
        )
        opts.add(
            "working_dir",
            type_=str,
            default=None,
            help="directory uploaded as the job's working directory (default: the roles' image "
            "when it is a local directory); .gitignore'd files stay behind",
        )
        opts.add(
            "requirements",
            type_=str,
            default=None,
            help="requirements.txt installed into the job's environment (runtime_env pip)",
        )
        return opts

    def _submit_dryrun(self, app: AppDef, cfg: RayJobOpts) -> AppDryRunInfo[RayJobRequest]:
        netloc = dashboard_netloc(str(cfg.get("dashboard_address") or DEFAULT_DASHBOARD))
        app_id = make_unique(app.name)
        working_dir = _working_dir(app, cfg.get("working_dir"))
        replicas = []
        for role in app.roles:
            for replica_id in range(role.num_replicas):
                values = macros.Values(
                    # Replicas start in the uploaded copy when there is one.
                    img_root="." if working_dir else role.image,
                    app_id=app_id,
                    replica_id=str(replica_id),
                    rank0_env=RANK0_ENV,
                )
                resolved = values.apply(role)
                replicas.append(
                    ReplicaSpec(
                        role=role.name,
                        replica_id=replica_id,
                        command=[resolved.entrypoint, *resolved.args],
                        env=dict(resolved.env),
                        resources=_resources(role),
                    )
                )
        # Replicas are python processes writing into a pipe: unbuffered, their lines arrive as
        # they are written, and none are lost when a replica is killed.
        runtime_env: dict[str, Any] = {
            "py_modules": [str(DRIVER)],
            "env_vars": {"PYTHONUNBUFFERED": "1"},
        }
        if working_dir:
            runtime_env["working_dir"] = working_dir
        if cfg.get("requirements"):
            runtime_env["pip"] = str(cfg["requirements"])
        spec = json.dumps([asdict(r) for r in replicas], separators=(",", ":"))
        request = RayJobRequest(
            dashboard_address=netloc,
            submission_id=app_id,
            entrypoint=f"python -m {DRIVER.name} {shlex.quote(spec)}",
            runtime_env=runtime_env,
            metadata={ROLES_KEY: json.dumps({r.name: r.num_replicas for r in app.roles})},
            replicas=replicas,
        )
        return AppDryRunInfo(request, str)

    def schedule(self, dryrun_info: AppDryRunInfo[RayJobRequest]) -> str:
        req: RayJobRequest = dryrun_info.request
        client = _client(req.dashboard_address)
        client.submit_job(
            entrypoint=req.entrypoint,
            submission_id=req.submission_id,
            runtime_env=req.runtime_env,
            metadata=req.metadata,
        )
        return f"{req.dashboard_address}-{req.submission_id}"

    def _job(self, app_id: str) -> Any | None:
        netloc, job_id = _split_app_id(app_id)
        try:
            return _client(netloc).get_job_info(job_id)
        except RuntimeError as err:
            if "status code 404" in str(err):
                return None
            raise

    def describe(self, app_id: str) -> DescribeAppResponse | None:
        job = self._job(app_id)
        if job is None:
            return None
        state = _state(job.status)
        counts: dict[str, int] = json.loads((job.metadata or {}).get(ROLES_KEY, "{}"))
        return DescribeAppResponse(
            app_id=app_id,
            state=state,
            msg=job.message or "",
            roles=[Role(name=n, image="", num_replicas=k) for n, k in counts.items()],
            roles_statuses=[
                RoleStatus(n, [ReplicaStatus(i, state, n, hostname="") for i in range(k)])
                for n, k in counts.items()
            ],
        )

    def list(self, cfg: Mapping[str, Any] | None = None) -> list[ListAppResponse]:
        """Apps this scheduler submitted to the dashboard of ``cfg`` (TorchX >= 0.8 passes it),
        else of ``RAY_ADDRESS``, else of the default address."""
        address = (cfg or {}).get("dashboard_address") or os.environ.get("RAY_ADDRESS")
        netloc = dashboard_netloc(str(address or DEFAULT_DASHBOARD))
        return [
            ListAppResponse(app_id=f"{netloc}-{job.submission_id}", state=_state(job.status))
            for job in _client(netloc).list_jobs()
            if job.submission_id and ROLES_KEY in (job.metadata or {})
        ]

    def _cancel_existing(self, app_id: str) -> None:
        netloc, job_id = _split_app_id(app_id)
        _client(netloc).stop_job(job_id)

    def log_iter(
        self,
        app_id: str,
        role_name: str | None = None,
        k: int = 0,
        regex: str | None = None,
        since: datetime | None = None,
        until: datetime | None = None,
        should_tail: bool = False,
        streams: Stream | None = None,
    ) -> Iterable[str]:
        """Lines replica ``k`` of ``role_name`` wrote (stdout and stderr together), without
        their ``[role/k]`` prefix; every line of the job log when ``role_name`` is empty.
        ``since``/``until`` are not supported (Ray's job log has no timestamps)."""
        prefix = f"[{role_name}/{k}] " if role_name else ""
        lines = self._tail(app_id) if should_tail else split_lines(self._logs(app_id))
        ours = (line[len(prefix) :] for line in lines if line.startswith(prefix))
        return filter_regex(regex, ours) if regex else ours

    def _logs(self, app_id: str) -> str:
        netloc, job_id = _split_app_id(app_id)
        return str(_client(netloc).get_job_logs(job_id))

    def _tail(self, app_id: str, poll_s: float = 1.0) -> Iterator[str]:
        """Complete lines of the job log as they arrive, until the job has ended."""
        done = 0
        while True:
            job = self._job(app_id)
            ended = job is None or _state(job.status) in (
                AppState.SUCCEEDED,
                AppState.FAILED,
                AppState.CANCELLED,
            )
            lines = split_lines(self._logs(app_id))
            complete = lines if ended else [ln for ln in lines if ln.endswith("\n")]
            yield from complete[done:]
            done = len(complete)
            if ended:
                return
            time.sleep(poll_s)


def create_scheduler(session_name: str, **kwargs: Any) -> RayJobScheduler:
    """This scheduler as ``distopt_ray``."""
    return RayJobScheduler(session_name, backend="distopt_ray")


def create_ray_scheduler(session_name: str, **kwargs: Any) -> RayJobScheduler:
    """This scheduler as ``ray``, for TorchX releases without their own (:mod:`.schedulers`)."""
    return RayJobScheduler(session_name, backend="ray")
