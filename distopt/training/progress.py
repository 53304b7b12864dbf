"""Training progress: a tqdm bar on a terminal, periodic log lines otherwise (CI, log files)."""

from __future__ import annotations

import logging
import sys
import time
from typing import TextIO

from tqdm import tqdm

logger = logging.getLogger(__name__)


class Progress:
    """Reports steps of one trainer; silent on every rank but ``rank`` 0 unless ``all_ranks``.

    Without a terminal every ``log_every`` steps is an INFO record of ``distopt.training.progress``.
    """

    def __init__(
        self,
        *,
        total: int,
        rank: int,
        log_every: int,
        start: int = 0,
        stream: TextIO | None = None,
        all_ranks: bool = False,
    ) -> None:
        self.stream = sys.stderr if stream is None else stream
        self.total = total
        self.rank = rank
        self.log_every = log_every
        self.enabled = all_ranks or rank == 0
        self._started = time.perf_counter()
        self._bar = None
        if self.enabled and self.stream.isatty():
            self._bar = tqdm(
                total=total, initial=start, file=self.stream, desc=f"trainer {rank}", unit="step"
            )

    def update(self, step: int, *, loss: float, qps: float) -> None:
        """Called after ``step`` (0-based) finished."""
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.set_postfix(loss=f"{loss:.4g}", qps=f"{qps:,.0f}", refresh=False)
            self._bar.update(1)
        elif (step + 1) % self.log_every == 0 or step + 1 == self.total:
            logger.info(
                "step %d/%d loss %.4g qps %s elapsed %.1fs",
                step + 1,
                self.total,
                loss,
                f"{qps:,.1f}",
                time.perf_counter() - self._started,
            )

    def note(self, message: str) -> None:
        """An INFO line that does not tear the bar."""
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.write(message, file=self.stream)
        else:
            logger.info("%s", message)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
