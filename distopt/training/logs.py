"""Logging of a job process: the ``distopt`` logger tree, one line per record on stderr.

Level from ``DISTOPT_LOG_LEVEL`` (``DEBUG``, ``INFO`` (default), ``WARNING``, ``ERROR``); every
line names the process's role and rank, so the interleaved output of a local job stays readable::

    2026-11-20 10:00:01 INFO [trainer 0] distopt.training.trainer: step 10/100 loss 0.6931 ...

Only distopt's loggers are configured: other libraries keep their own settings.
"""

from __future__ import annotations

import logging
import os
import sys

from torch.distributed.elastic.multiprocessing.errors import get_error_handler

from distopt.errors import ConfigError

LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
_HANDLER_NAME = "distopt.training"


def log_level(environ: dict[str, str] | None = None) -> int:
    """The level ``DISTOPT_LOG_LEVEL`` names (default INFO)."""
    raw = (os.environ if environ is None else environ).get("DISTOPT_LOG_LEVEL") or "INFO"
    if raw.upper() not in LEVELS:
        raise ConfigError(
            f"environment DISTOPT_LOG_LEVEL: expected one of {', '.join(LEVELS)}, got {raw!r}"
        )
    return int(getattr(logging, raw.upper()))


def configure(role: str, rank: int, *, level: int | None = None) -> logging.Logger:
    """Send the ``distopt`` loggers' records to stderr, tagged ``[role rank]``."""
    logger = logging.getLogger("distopt")
    logger.setLevel(log_level() if level is None else level)
    for handler in [h for h in logger.handlers if h.get_name() == _HANDLER_NAME]:
        logger.removeHandler(handler)
    handler = logging.StreamHandler(sys.stderr)
    handler.set_name(_HANDLER_NAME)
    handler.setFormatter(
        logging.Formatter(
            f"%(asctime)s %(levelname)s [{role} {rank}] %(name)s: %(message)s", "%Y-%m-%d %H:%M:%S"
        )
    )
    logger.addHandler(handler)
    logger.propagate = False
    return logger


def record_failure(err: BaseException) -> None:
    """Record why this process failed in torchelastic's error file (``$TORCHELASTIC_ERROR_FILE``,
    set by TorchX and torchrun for each process), unless it holds a record already.

    Call it the moment the process fails, before it tells the others (aborting the servers): the
    launcher takes the process whose error file was written first for the one that failed first
    (TorchX's ``structured_error_msg``, :mod:`distopt.torchx.watch`), and a later call for the same
    failure must not move that time.
    """
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path or os.path.exists(path):
        return
    get_error_handler().record_exception(err)


__all__ = ["LEVELS", "configure", "log_level", "record_failure"]
