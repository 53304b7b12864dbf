"""Job logging: DISTOPT_LOG_LEVEL, role and rank on every line."""

from __future__ import annotations

import logging

import pytest

from distopt.errors import ConfigError
from distopt.training.logs import configure, log_level


def test_level_from_the_environment() -> None:
    assert log_level({}) == logging.INFO
    assert log_level({"DISTOPT_LOG_LEVEL": "debug"}) == logging.DEBUG
    with pytest.raises(ConfigError, match="^environment DISTOPT_LOG_LEVEL: expected one of DEBUG"):
        log_level({"DISTOPT_LOG_LEVEL": "loud"})


def test_lines_name_role_and_rank(capsys: pytest.CaptureFixture[str]) -> None:
    logger = configure("trainer", 3, level=logging.WARNING)
    try:
        logging.getLogger("distopt.training.x").info("hidden")
        logging.getLogger("distopt.training.x").warning("shown")
        err = capsys.readouterr().err
        assert "hidden" not in err and "WARNING [trainer 3] distopt.training.x: shown" in err
        configure("ps", 0)  # reconfiguring replaces the handler: one line per record
        logging.getLogger("distopt.training.x").warning("once")
        assert capsys.readouterr().err.count("once") == 1
    finally:
        for handler in list(logger.handlers):
            logger.removeHandler(handler)
        logger.propagate = True
        logger.setLevel(logging.NOTSET)
