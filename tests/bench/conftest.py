"""The benchmarks' tests check what a benchmark runs, scores and logs, not how well its
predictions are known: their rehearsals stop at the least rounds. With settling rehearsals, which
add rounds while a gain moves (up to 30 s a point), three ps_overlap tests took 42–45 s each in
the suite, where none had taken 40; docs/cost_model.md says why a real run settles."""

from __future__ import annotations

import pytest

from distopt.optimize import gain


@pytest.fixture(autouse=True)
def _least_rehearsal_rounds(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gain, "REHEARSAL_MAX_ROUNDS", gain.REHEARSAL_ROUNDS)
