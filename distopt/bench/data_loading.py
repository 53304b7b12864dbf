"""Data loading out of the step time: a DLRM job's QPS with loader workers vs pre-built batches.

One trainer and a real parameter-server process (``distopt.ps.local_job``) train the job config's
DLRM on a generated Criteo-format click log with the trainer of ``python -m distopt.train``, in
interleaved rounds of two arms (the order alternates each round):

- ``loader``: the job's data as configured, read by ``data.num_workers`` loader processes
  (gathering, collating and sending batches overlap the steps; the click log is parsed when it is
  opened, before the rounds, as a job opens its data before its first step);
- ``prebuilt``: the same first batches, read and collated before the chunk and cycled from
  memory (no loading at all; the old ``data_batches`` way).

A step's time includes waiting for its batch (see :mod:`distopt.training.trainer`), so a loader that
falls behind lowers QPS. Each chunk drops its first ``warmup`` steps (first fetches; in the
first ``loader`` chunk, the workers' start-up). The result is the ratio of median QPS, loader over prebuilt; the benchmark exits 1
when it is under ``target_ratio``. The machine's load average is reported with it (other
processes share the cores).

The chunks of an arm are one job cut into pieces, so the ``loader`` arm's chunks continue one
loader's batches (0-39, 40-79, ... with 40 steps; its workers start once), as the steps of a job
do. A loader per chunk forked two new workers every chunk, and each 40-step chunk then paid what
a long job pays once: copy-on-write faults in the trainer after the fork (6,400 a chunk, against
1,200 with pre-built batches: 0.05-0.08 s of trainer CPU), the workers' start-up, and the
batches in flight when the chunk ended (77 of the 117 made were unused; measured on 2 cores).

The trainer runs with the job's ``num_threads``, as ``python -m distopt.train`` sets it. Left at
torch's default (2 on a 2-core machine), the trainer's idle OpenMP thread spin-waited between
operators and took a core in both arms (measured: the trainer used 1.1 s of CPU per 40-step
chunk, 0.45 s with the job's 1 thread).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from rich.table import Table

import distopt.ps as ps
from distopt import models
from distopt.config import check, from_dict, load_config
from distopt.console import console as make_console
from distopt.data import Batch, DataSource, IndexedStream, Loader, build_data, to_batch
from distopt.data.generate import write_criteo
from distopt.dist.env import JobEnv
from distopt.metrics import load_run
from distopt.roles.ps_setup import job_tables
from distopt.training.config import JobConfig
from distopt.training.trainer import Hooks, train

ARMS = ("loader", "prebuilt")
PREDICTED_RATIO = 1.0
"""Loader over prebuilt QPS as the cost model predicts it: its ``data`` phase is 0 in both."""


@dataclasses.dataclass(kw_only=True, slots=True)
class DataLoadingConfig:
    job: str = "configs/jobs/dlrm_criteo.yaml"
    """The DLRM job config (its model, batch size, optimizer and ``data`` settings)."""
    samples: int = 20_000
    """Lines of the generated click log."""
    num_workers: int = 2
    """Loader processes of the ``loader`` arm."""
    rounds: int = 4
    """Interleaved rounds; each runs ``steps`` steps of both arms."""
    steps: int = 40
    """Steps per chunk; also the number of distinct pre-built batches."""
    warmup: int = 5
    """Steps dropped at the start of each chunk."""
    target_ratio: float = 0.95
    """Target: loader QPS ≥ this × prebuilt QPS (medians)."""
    latency_ms: float | None = None
    """Injected server latency per request; ``None``: the job config's ``ps.latency_ms``."""
    output_dir: str = "runs/bench/data_loading"
    """The click log and the chunks' QPS logs go here."""

    def __post_init__(self) -> None:
        check(self.samples >= 100, "samples", "an integer >= 100", self.samples)
        check(self.num_workers >= 1, "num_workers", "an integer >= 1", self.num_workers)
        check(self.rounds >= 1, "rounds", "an integer >= 1", self.rounds)
        check(
            self.steps > self.warmup >= 0,
            "steps",
            f"an integer > warmup ({self.warmup})",
            self.steps,
        )
        check(0 < self.target_ratio, "target_ratio", "a number > 0", self.target_ratio)


class PrebuiltBatches(IndexedStream[Batch]):
    """Batches made before training, cycled: batch ``i`` of any rank is ``batches[i % n]``."""

    batched = True

    def __init__(self, batches: list[Batch]) -> None:
        self.batches = batches

    def item(self, rank: int, index: int) -> Batch:
        return self.batches[index % len(self.batches)]


class OneStream:
    """One loader's training batches, continued by every chunk: :meth:`batches` gives the same
    endless iterator each time (``start_step`` is 0 in every chunk: the benchmark never resumes)."""

    def __init__(self, loader: Loader) -> None:
        self.stream = loader.batches(0)

    def batches(self, start_step: int = 0) -> Iterator[Any]:
        return self.stream


@dataclasses.dataclass(frozen=True)
class OneJobData(DataSource):
    """A data source whose training loader (workers included) is made once, for every chunk."""

    streams: dict[tuple[int, ...], OneStream] = dataclasses.field(
        default_factory=dict, compare=False
    )

    def train_loader(self, *, rank: int, world_size: int, batch_size: int, seed: int) -> Loader:
        key = (rank, world_size, batch_size, seed)
        if key not in self.streams:
            self.streams[key] = OneStream(
                DataSource.train_loader(
                    self, rank=rank, world_size=world_size, batch_size=batch_size, seed=seed
                )
            )
        return self.streams[key]  # type: ignore[return-value]  # the trainer only calls batches()


def _sources(job: JobConfig, bench: DataLoadingConfig) -> dict[str, DataSource]:
    model = models.build(job.model_name, **job.model_kwargs)
    built = build_data(
        dataclasses.replace(job.data, num_workers=bench.num_workers),
        model_name=job.model_name,
        model=model,
        batch_size=job.batch_size,
        seed=job.seed,
    )
    loading = OneJobData(**{f.name: getattr(built, f.name) for f in dataclasses.fields(DataSource)})
    # The first `steps` batches of the same loader (in this process), kept in memory.
    reader = build_data(
        dataclasses.replace(job.data, num_workers=0),
        model_name=job.model_name,
        model=model,
        batch_size=job.batch_size,
        seed=job.seed,
    )
    stream = reader.train_loader(rank=0, world_size=1, batch_size=job.batch_size, seed=job.seed)
    batches = [to_batch(b) for _, b in zip(range(bench.steps), stream.batches(), strict=False)]
    prebuilt = DataSource(
        train=PrebuiltBatches(batches),
        eval=None,
        collate_fn=None,
        batched=True,
        task=loading.task,
        config=dataclasses.replace(job.data, num_workers=0),
    )
    return {"loader": loading, "prebuilt": prebuilt}


def _chunk(
    job: JobConfig, source: DataSource, run_id: str, warmup: int
) -> tuple[list[float], list[float]]:
    """Step times and ``data`` phases of one chunk (after warm-up), read back from its QPS log."""

    def push(_model: Any) -> None:
        ps.push_gradients(lr=job.lr)  # async, as a job pushes without deterministic

    hooks = Hooks(before_loop=ps.discard_step, after_backward=push)
    result = train(dataclasses.replace(job, run_id=run_id), JobEnv(), hooks=hooks, source=source)
    ps.flush()  # the last async push belongs to this chunk
    steps = load_run(result.log_path).ranks[0].steps[warmup:]
    return [s.step_time_s for s in steps], [(s.phases or {}).get("data", 0.0) for s in steps]


def measure(bench: DataLoadingConfig) -> dict[str, Any]:
    """Run the interleaved rounds; the results as plain data."""
    out = Path(bench.output_dir)
    clicks = write_criteo(out / "clicks.tsv", num_samples=bench.samples, seed=0)
    job = load_config(
        JobConfig,
        bench.job,
        [
            f"data.path={clicks}",
            f"output_dir={out}",
            f"steps={bench.steps}",
            "parallel=none",
            "eval={every: 0, at_end: false}",
            "checkpoint_every=0",
            "tensorboard=false",
            "deterministic=false",
            "data.holdout_fraction=0.0",
            "log_every=1000000",
        ],
    )
    options = dataclasses.replace(job.ps, num_servers=1, host="127.0.0.1")
    if bench.latency_ms is not None:
        options = dataclasses.replace(options, latency_ms=bench.latency_ms)
    load_before = os.getloadavg()
    times: dict[str, list[float]] = {arm: [] for arm in ARMS}
    data: dict[str, list[float]] = {arm: [] for arm in ARMS}
    threads = torch.get_num_threads()
    if job.num_threads is not None:
        torch.set_num_threads(job.num_threads)
    try:
        with ps.local_job(job_tables(job), options):
            sources = _sources(job, bench)
            for round_index in range(bench.rounds):
                order = ARMS if round_index % 2 == 0 else ARMS[::-1]
                for arm in order:
                    steps, waited = _chunk(job, sources[arm], f"{arm}-{round_index}", bench.warmup)
                    times[arm] += steps
                    data[arm] += waited
            sources.clear()  # the loader's workers end before the server does
    finally:
        torch.set_num_threads(threads)
    qps = {arm: job.batch_size / statistics.median(t) for arm, t in times.items()}
    ratio = qps["loader"] / qps["prebuilt"]
    return {
        "job": bench.job,
        "batch_size": job.batch_size,
        "num_workers": bench.num_workers,
        "latency_ms": options.latency_ms,
        "rounds": bench.rounds,
        "steps_per_chunk": bench.steps,
        "arms": {
            arm: {
                "median_qps": qps[arm],
                "median_step_s": statistics.median(times[arm]),
                "median_data_s": statistics.median(data[arm]),
                "steps": len(times[arm]),
                "step_times_s": times[arm],
            }
            for arm in ARMS
        },
        "ratio": ratio,
        "target_ratio": bench.target_ratio,
        # The cost model's data phase is 0 (the loader keeps up: docs/cost_model.md), so it
        # predicts the arms alike; this benchmark is where that assumption is checked.
        "predicted_ratio": PREDICTED_RATIO,
        "prediction_error": PREDICTED_RATIO / ratio - 1,
        "load_average_before": load_before,
        "load_average_after": os.getloadavg(),
        "cpu_count": os.cpu_count(),
        "num_threads": job.num_threads,
    }


def run(config: dict[str, Any], args: argparse.Namespace) -> int:
    bench = from_dict(DataLoadingConfig, config)
    result = measure(bench)
    console = make_console()
    table = Table(
        title=f"DLRM QPS: {bench.num_workers} loader workers vs pre-built batches "
        f"(batch {result['batch_size']}, {bench.rounds} rounds × {bench.steps} steps)"
    )
    for column in ("arm", "median QPS", "median step (ms)", "data phase (ms)", "steps"):
        table.add_column(column, justify="left" if column == "arm" else "right")
    for arm in ARMS:
        data = result["arms"][arm]
        table.add_row(
            arm,
            f"{data['median_qps']:,.0f}",
            f"{1000 * data['median_step_s']:.2f}",
            f"{1000 * data['median_data_s']:.2f} (predicted 0)",
            str(data["steps"]),
        )
    console.print(table)
    load = " / ".join(f"{x:.2f}" for x in result["load_average_after"])
    ok = result["ratio"] >= bench.target_ratio
    console.print(
        f"loader / prebuilt = {result['ratio']:.3f} (target ≥ {bench.target_ratio}): "
        f"{'met' if ok else 'MISSED'}; predicted {result['predicted_ratio']:.2f} (the cost "
        f"model's data phase is 0), error {result['prediction_error']:+.1%}; load average {load} "
        f"on {result['cpu_count']} CPUs"
    )
    if getattr(args, "json", None):
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0 if ok else 1
