"""The ``data:`` section of a job: where batches come from and how they are loaded."""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

from distopt.config import check
from distopt.data.factory import load_factory

BUILTIN_SOURCES = ("synthetic", "criteo", "tokens")
Task = Literal["click", "tokens", "none"]


@dataclasses.dataclass(kw_only=True, slots=True)
class DataConfig:
    """A data source, its held-out split and its loader settings."""

    source: str = "synthetic"
    """``synthetic`` (the model's example inputs), ``criteo`` (click logs for DLRM), ``tokens``
    (a token file for a GPT), or ``package.module:function`` (see :mod:`distopt.data.factory`)."""
    path: str | None = None
    """The training file (``criteo``, ``tokens``)."""
    eval_path: str | None = None
    """A separate held-out file of the same format; excludes ``holdout_fraction``."""
    holdout_fraction: float = 0.0
    """Hold out the last fraction of ``path`` for evaluation (lines of a click log, tokens of a
    token file, indices of a map-style factory dataset); 0: no held-out data unless ``eval_path``."""
    kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)
    """Keyword arguments of a factory ``source``."""
    task: Task | None = None
    """What evaluation computes for a factory's data: ``click`` (BCE, AUC), ``tokens`` (cross
    entropy, perplexity), ``none`` (the model's loss); built-in sources know theirs."""
    num_workers: int = 0
    """Loader worker processes per trainer (0: load in the training process)."""
    pin_memory: bool = True
    """Pin host batches for faster copies to a GPU (ignored without CUDA)."""
    shuffle: bool = True
    """Reshuffle map-style data every epoch (seeded by the job seed and the epoch)."""
    drop_last: bool = True
    """Drop each epoch's last, partial batch (map-style data)."""
    table_of_feature: tuple[int, ...] | None = None
    """``criteo``: the table of each of the 26 categorical features; default ``j % num_tables``."""
    cache_dir: str | None = None
    """``criteo``: where the parsed form of a click log is cached (one file per log and table
    layout, memory-mapped by every trainer and loader worker); default: next to the log."""
    token_dtype: Literal["uint16", "uint32"] = "uint16"
    """``tokens``: the integer type of the token file."""
    synthetic_batches: int = 4
    """``synthetic``: distinct batches per trainer, cycled."""

    def __post_init__(self) -> None:
        check(
            isinstance(self.source, str) and (self.source in BUILTIN_SOURCES or ":" in self.source),
            "data.source",
            "synthetic, criteo, tokens or package.module:function",
            self.source,
        )
        if ":" in self.source:
            load_factory(
                self.source
            )  # a factory that does not import fails the config, not the job
        elif self.source != "synthetic":
            check(bool(self.path), "data.path", f"a file for source {self.source!r}", self.path)
        check(
            0.0 <= self.holdout_fraction < 1.0,
            "data.holdout_fraction",
            "a number in [0, 1)",
            self.holdout_fraction,
        )
        check(
            self.eval_path is None or self.holdout_fraction == 0.0,
            "data.eval_path",
            "no eval_path when holdout_fraction is set",
            self.eval_path,
        )
        check(
            self.eval_path is None or self.source in ("criteo", "tokens"),
            "data.eval_path",
            "no eval_path for this source (a factory takes a split argument instead)",
            self.eval_path,
        )
        check(
            self.source != "synthetic" or (self.holdout_fraction == 0.0 and self.eval_path is None),
            "data.holdout_fraction",
            "0 for synthetic data (it has no held-out set)",
            self.holdout_fraction,
        )
        check(
            self.cache_dir is None or (bool(self.cache_dir) and self.source == "criteo"),
            "data.cache_dir",
            "a directory, for source criteo",
            self.cache_dir,
        )
        check(
            self.task is None or ":" in self.source,
            "data.task",
            "no task for a built-in source",
            self.task,
        )
        check(self.num_workers >= 0, "data.num_workers", "an integer >= 0", self.num_workers)
        check(
            self.synthetic_batches >= 1,
            "data.synthetic_batches",
            "an integer >= 1",
            self.synthetic_batches,
        )

    @property
    def resolved_task(self) -> Task:
        """What evaluation computes: fixed by built-in sources, ``task`` (default none) otherwise."""
        builtin: dict[str, Task] = {"criteo": "click", "tokens": "tokens", "synthetic": "none"}
        return builtin.get(self.source) or self.task or "none"


__all__ = ["BUILTIN_SOURCES", "DataConfig", "Task"]
