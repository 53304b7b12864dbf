"""``distopt.launch``: submit a job config through TorchX, the same way on every scheduler.

::

    job = distopt.launch("configs/jobs/dlrm_criteo.yaml", "local_cwd",
                         overrides=["variant=optimized"], num_trainers=2)
    status = job.wait()                      # local schedulers: keep ``job`` until it is done
    print(job.handle, job.run_id, job.run_dir)

What it does, in order, so bad input fails before anything is scheduled:

1. loads and validates the whole config (unknown keys, bad values, optimizer names and arguments,
   data factories that do not import: :class:`~distopt.training.config.JobConfig`) and the scheduler
   options (:func:`scheduler_options`);
2. :func:`check_job`: builds the model and opens its data (missing or malformed files, with the
   line), puts the first batch through the collate function against the model's forward,
   checks the model's remote calls against the servers the job starts, and on a local scheduler
   ``device: cuda`` against this host's GPUs (:mod:`distopt.torchx.preflight`);
3. writes the resolved config, run id included, to ``<output_dir>/<run_id>/job.yaml`` and runs
   the TorchX component for the job's shape (:data:`COMPONENTS`) on it with TorchX's Runner
   (:func:`distopt.torchx.schedulers.get_runner`: TorchX's schedulers and distopt's Ray one).
   Scheduler options come from ``**cfg`` over ``.torchxconfig`` (``[<scheduler>]`` sections);
   component defaults from its ``[component:<name>]`` sections. A dry run leaves nothing behind:
   the config file is removed again, with the folders made for it.

The job's processes read ``job.yaml``, so ``output_dir`` must be where they can read it: the
workspace (``local_cwd``, Ray's working directory) or a shared filesystem (Slurm).
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import secrets
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TextIO

import yaml
from torchx.runner import config as torchx_config
from torchx.schedulers import get_scheduler_factories
from torchx.specs import AppState

from distopt.config import load_config, to_dict
from distopt.data import build_data
from distopt.dist.rendezvous import free_port, run_port
from distopt.errors import ConfigError
from distopt.torchx import preflight, watch
from distopt.torchx.schedulers import apply_torchxconfig, distopt_schedulers, get_runner
from distopt.training.config import JobConfig
from distopt.training.device import resolve_device
from distopt.training.telemetry import summary_writer_class

COMPONENTS = {"ps": "distopt.ps_job", "spmd": "distopt.spmd"}
"""The TorchX component that runs each shape of job: with parameter servers, or trainers only
(DDP or FSDP). Names are ``torchx.components`` entry points (see ``pyproject.toml``)."""
LOCAL_SCHEDULERS = ("local_cwd", "local_docker")
"""Schedulers whose processes run on this host: the GPU check applies here."""


@dataclasses.dataclass(kw_only=True)
class Launched:
    """A submitted job (or a dry run). Local schedulers' processes are children of ``runner``:
    keep this object until :meth:`wait` returns (closing it stops them)."""

    handle: str | None
    """TorchX app handle, e.g. ``local_cwd://torchx/distopt-ps-x1y2``; ``None`` for a dry run."""
    run_id: str
    """The run id every process logs under."""
    run_dir: Path
    """``<output_dir>/<run_id>``: QPS logs, TensorBoard events, checkpoints, ``job.yaml``."""
    config: JobConfig
    """The job's config as resolved (overrides and run id applied): ``run_dir/job.yaml``'s
    content (a dry run writes no file)."""
    component: str
    args: list[str]
    """The component's arguments."""
    dryrun: Any = None
    """TorchX ``AppDryRunInfo`` of a dry run (its ``request`` is what would be submitted)."""
    runner: Any = None

    def status(self) -> Any:
        """TorchX ``AppStatus`` of the job."""
        return None if self.handle is None else self.runner.status(self.handle)

    def wait(self, interval_s: float = 1.0) -> Any:
        """Block until the job ends; its final TorchX ``AppStatus``."""
        if self.handle is None:
            return None
        return self.runner.wait(self.handle, wait_interval=interval_s)

    def stream(
        self, role: str = "trainer", replica: int = 0, file: TextIO | None = None
    ) -> threading.Thread:
        """Print the log of ``role``'s replica ``replica`` as it comes (default: trainer 0's
        progress) on a thread that ends with the job: join it after :meth:`wait`."""
        if self.handle is None:
            raise ConfigError("stream: a dry run has no logs")
        return watch.stream(self.runner, self.handle, role=role, replica=replica, file=file)

    def logs_elsewhere(self) -> str | None:
        """For a job that succeeded without a QPS log in :attr:`run_dir`: where its processes wrote
        theirs (they did not see this machine's run dir, e.g. on a remote Ray cluster: see
        :func:`distopt.training.config.launched_output_dir`), one line; ``None`` when the logs
        are here."""
        if self.handle is None or any(self.run_dir.glob("qps-rank*.jsonl")):
            return None
        said = f"run {self.run_id}: "
        try:
            lines = list(self.runner.log_lines(self.handle, "trainer", 0))
        except Exception:  # a scheduler that keeps no logs
            lines = []
        final = [line.strip() for line in lines if said in line and " QPS log " in line]
        where = f" (trainer 0: {final[-1][final[-1].index(said) :]})" if final else ""
        return (
            f"run {self.run_id}: no QPS log in {self.run_dir}: the job's processes did not see "
            f"this directory and wrote {Path(self.config.output_dir) / self.run_id} where they "
            f"ran{where}; copy it to {self.run_dir} to compare it"
        )

    def failure(self, status: Any = None) -> watch.Failure | None:
        """Which process of a failed job failed first, its exit code, its error and the end of
        its log (:mod:`distopt.torchx.watch`); ``None`` for a job that did not fail."""
        status = status if status is not None else self.status()
        if self.handle is None or status is None or status.state != AppState.FAILED:
            return None
        return watch.failure(self.runner, self.handle, status)

    def failure_report(self, status: Any) -> str | None:
        """What to tell the user of a job that ended with ``status``: ``None`` when it
        succeeded; else its :meth:`failure` formatted, or its final state when no process failed
        (cancelled, unknown)."""
        if getattr(status, "state", None) == AppState.SUCCEEDED:
            return None
        failed = self.failure(status)
        return failed.format() if failed else f"{self.handle}: {getattr(status, 'state', None)}"

    def close(self) -> None:
        if self.runner is not None:
            self.runner.close()
            self.runner = None

    def __enter__(self) -> Launched:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclasses.dataclass(kw_only=True, slots=True)
class CheckedJob:
    """What :func:`check_job` found: the model as built, the servers the job starts and where
    its replicas import the job's own code from."""

    model: Any
    """On the meta device when its factory builds there."""
    num_ps: int
    python_path: list[str]
    """Directories for the replicas' ``PYTHONPATH`` (:func:`distopt.torchx.preflight.import_roots`)."""


def check_job(
    config: JobConfig, *, local: bool = True, num_trainers: int = 2, num_ps: int | None = None
) -> CheckedJob:
    """What a job needs before it is scheduled (:mod:`distopt.torchx.preflight`): the model builds,
    its data opens (files read and validated) and its first batch fits the model's forward, the
    model's remote calls have servers to go to, its row caches are of tables it reads and fit
    in memory, TensorBoard is importable when on, and
    (``local``) a GPU for ``device: cuda``. ``num_ps`` ``None``: 1 when the model has
    ``ps_tables()``, else 0."""
    if num_trainers < 1:
        raise ConfigError(f"num_trainers: expected an integer >= 1, got {num_trainers!r}")
    if num_ps is not None and num_ps < 0:
        raise ConfigError(f"num_ps: expected an integer >= 0, got {num_ps!r}")
    if local:
        resolve_device(config.device)
    model = preflight.build_model(config)
    if num_ps is None:
        num_ps = 1 if callable(getattr(model, "ps_tables", None)) else 0
    source = build_data(
        config.data,
        model_name=config.model_name,
        model=model,
        batch_size=config.batch_size,
        seed=config.seed,
    )
    preflight.check_first_batch(source, model, config, num_trainers=num_trainers)
    calls = preflight.remote_calls(model, config)
    preflight.check_remote_calls(model, config, calls, num_ps=num_ps, num_trainers=num_trainers)
    preflight.check_caches(model, config, calls)
    if config.tensorboard:
        summary_writer_class()
    roots = preflight.import_roots(preflight.user_modules(model, config, calls or ()))
    return CheckedJob(model=model, num_ps=num_ps, python_path=roots)


def _write_config(config: JobConfig, run_dir: Path) -> Path:
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / "job.yaml"
    path.write_text(yaml.safe_dump(to_dict(config), sort_keys=False))
    return path


def _component_args(
    kind: str,
    config_path: Path,
    num_trainers: int,
    num_ps: int,
    extra: Mapping[str, Any],
    *,
    device: str,
) -> list[str]:
    args = ["--config", str(config_path)]
    if kind == "ps":
        args += ["--num_ps", str(num_ps), "--num_trainers", str(num_trainers)]
    else:
        args += ["--nproc_per_node", str(num_trainers)]
    if device == "cuda" and not {"gpu", "h"} & set(extra):
        # One GPU per trainer process: per replica for ps_job, per node (all its trainers) for torchrun.
        args += ["--gpu", "1" if kind == "ps" else str(num_trainers)]
    for key, value in extra.items():
        if isinstance(value, Mapping):
            value = ",".join(f"{k}={v}" for k, v in value.items())
        elif isinstance(value, (list, tuple)):
            value = ",".join(map(str, value))
        args += [f"--{key}", str(value)]
    return args


def launch(
    config: str | os.PathLike[str] | JobConfig,
    scheduler: str = "local_cwd",
    *,
    overrides: Sequence[str] = (),
    num_trainers: int = 2,
    num_ps: int | None = None,
    run_id: str | None = None,
    component_args: Mapping[str, Any] | None = None,
    dryrun: bool = False,
    **cfg: Any,
) -> Launched:
    """Submit a job through TorchX (see the module docstring) and return its handle and run id.

    Args:
        config: a job YAML file or a :class:`JobConfig`.
        scheduler: a TorchX scheduler (``local_cwd``, ``slurm``, ``ray``, ``kubernetes``, ...) or
            ``distopt_ray`` (:mod:`distopt.torchx.schedulers`).
        overrides: ``key.sub=value`` overrides of the config, as ``--set`` takes them.
        num_trainers: trainer processes (``--num_trainers``; per node for DDP/FSDP jobs).
        num_ps: parameter-server processes; ``None``: 1 when the model has ``ps_tables()``,
            else 0 (a DDP or FSDP job, by ``parallel``).
        run_id: default: the config's, else ``<variant>-<time>-<random>``.
        component_args: more component arguments by name, e.g. ``{"cpu": 4, "memMB": 8192}``.
            With ``device: cuda`` and neither ``gpu`` nor ``h`` given, each trainer gets one GPU.
        dryrun: build the request without submitting it (``Launched.dryrun``).
        **cfg: scheduler options (``log_dir`` for local_cwd; ``partition``, ``account`` for slurm;
            ``dashboard_address`` for ray), over those of ``.torchxconfig``. On ``local_cwd``
            replica logs go to ``<run_dir>/logs`` unless ``log_dir`` says otherwise.
    """
    if isinstance(config, JobConfig):
        job = load_config(JobConfig, _scratch_yaml(config), list(overrides))
    else:
        job = load_config(JobConfig, Path(config), list(overrides))
    runner = get_runner(component_defaults=torchx_config.load_sections("component", [os.getcwd()]))
    try:
        options = scheduler_options(runner, scheduler, cfg)  # what the caller gave
        checked = check_job(
            job, local=scheduler in LOCAL_SCHEDULERS, num_trainers=num_trainers, num_ps=num_ps
        )
    except BaseException:
        runner.close()
        raise
    num_ps = checked.num_ps
    apply_torchxconfig(runner, scheduler, options, [os.getcwd()])

    run_id = (
        run_id
        or job.run_id
        or f"{job.variant}-{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(3)}"
    )
    job = dataclasses.replace(job, run_id=run_id)
    run_dir = Path(job.output_dir) / run_id
    if scheduler == "local_cwd" and not options.get("log_dir"):
        # Without one, local_cwd logs to a temporary directory it deletes when the runner closes.
        options["log_dir"] = str((run_dir / "logs").resolve())
    kind = "ps" if num_ps else "spmd"
    component = COMPONENTS[kind]
    extra = dict(component_args or {})
    if (
        kind == "ps"
        and scheduler != "local_docker"
        and "master_port" not in extra
        and "master_port" not in torchx_config.get_configs("component", component, [os.getcwd()])
    ):
        # Two jobs at once must not both take the default 29500: the second job's server failed
        # to host its store (two Slurm jobs on one node; on local_cwd a baseline and an optimized
        # run), and on one host its trainers joined the first job's. Every replica of a local_cwd
        # job runs here: two ports free now. Elsewhere the first server's host is not known
        # here: two ports of this run's own (rendezvous.run_port). A port the user chose
        # (--arg, or the .torchxconfig's [component:distopt.ps_job]) stays.
        if scheduler != "local_cwd":
            extra["master_port"] = run_port(run_id)
        elif not dryrun:
            extra["master_port"] = free_port(consecutive=2)
    env = dict(extra.get("env") or {})
    if checked.python_path:
        # The job's own code imports in the replicas from where it imported here.
        inherited = env.get("PYTHONPATH") or os.environ.get("PYTHONPATH")
        env["PYTHONPATH"] = os.pathsep.join([*checked.python_path, *filter(None, [inherited])])
    if scheduler not in LOCAL_SCHEDULERS:
        # Replicas may start in a copy of the workspace (Ray's working_dir): those that see this
        # machine's run dir write there, where this function says the logs are.
        env["DISTOPT_LAUNCH_RUN_DIR"] = str(run_dir.resolve())
    if env:
        extra["env"] = env
    # A dry run leaves nothing behind: the component reads the config (it checks it), so it is
    # written where the job would read it, then removed with the folders made for it (or an
    # earlier run's config put back).
    made = [d for d in (run_dir, *run_dir.parents) if not d.exists()]
    earlier = _read_if_there(run_dir / "job.yaml")
    config_path = _write_config(job, run_dir)
    args = _component_args(kind, config_path, num_trainers, num_ps, extra, device=job.device)
    launched = Launched(
        handle=None,
        run_id=run_id,
        run_dir=run_dir,
        config=job,
        component=component,
        args=args,
        runner=runner,
    )
    try:
        if dryrun:
            launched.dryrun = runner.dryrun_component(component, args, scheduler, cfg=options)
        else:
            launched.handle = runner.run_component(component, args, scheduler, cfg=options)
    except Exception as err:
        runner.close()
        message = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ConfigError(f"launch: {scheduler} refused {component}: {message}") from None
    finally:
        if dryrun:
            _undo_write(config_path, earlier, made)
    return launched


def _read_if_there(path: Path) -> bytes | None:
    return path.read_bytes() if path.is_file() else None


def _undo_write(path: Path, earlier: bytes | None, folders: Sequence[Path]) -> None:
    """``path`` back to its ``earlier`` content, or removed with ``folders`` (innermost first)
    as long as they are empty."""
    if earlier is not None:
        path.write_bytes(earlier)
        return
    path.unlink(missing_ok=True)
    for folder in folders:
        try:
            folder.rmdir()
        except OSError:  # something else was written there meanwhile
            break


def tails_replica_logs(scheduler: str) -> bool:
    """Whether ``scheduler`` gives one replica's log as it is written (:meth:`Launched.stream`):
    TorchX's local schedulers and distopt's Ray scheduler do; TorchX 0.7's own ``ray`` gives the
    whole job's log so far, every replica's lines together."""
    return scheduler in LOCAL_SCHEDULERS or scheduler in distopt_schedulers(
        get_scheduler_factories()
    )


def scheduler_options(runner: Any, scheduler: str, cfg: Mapping[str, Any]) -> dict[str, Any]:
    """``cfg`` checked against ``scheduler``'s run options, string values typed as TorchX types them.

    The one check of scheduler options, for :func:`launch` and ``distopt launch --cfg`` alike
    (the CLI only splits its string): an unknown scheduler or option is a one-line error, where
    TorchX's ``runopts.cfg_from_str`` would drop an unknown option without a word.
    """
    if scheduler not in runner.scheduler_backends():
        known = ", ".join(sorted(runner.scheduler_backends()))
        raise ConfigError(f"scheduler: unknown TorchX scheduler {scheduler!r} (known: {known})")
    run_opts = runner.scheduler_run_opts(scheduler)
    known_options = sorted(name for name, _ in run_opts)
    typed: dict[str, Any] = {}
    for key, value in cfg.items():
        if key not in known_options:
            close = difflib.get_close_matches(key, known_options, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ConfigError(
                f"cfg.{key}: not an option of the {scheduler} scheduler "
                f"(known: {', '.join(known_options)}){hint}"
            )
        if isinstance(value, str) and run_opts.get(key).opt_type is not str:
            try:
                value = run_opts.cfg_from_str(f"{key}={value}")[key]
            except (TypeError, ValueError) as err:
                raise ConfigError(f"cfg.{key}: {err}") from None
        typed[key] = value
    return typed


def _scratch_yaml(config: JobConfig) -> Path:
    """A config object as a file, so it is validated (and written) the same way as YAML."""
    path = Path(tempfile.mkdtemp(prefix="distopt-job-")) / "job.yaml"
    path.write_text(yaml.safe_dump(to_dict(config), sort_keys=False))
    return path


__all__ = [
    "COMPONENTS",
    "LOCAL_SCHEDULERS",
    "CheckedJob",
    "Launched",
    "check_job",
    "launch",
    "scheduler_options",
    "tails_replica_logs",
]
