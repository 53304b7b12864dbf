import pytest
import torch
from torch import nn

import distopt
from distopt.passes import run_passes
from distopt.passes.core.pass_base import resolve_pipeline
from distopt.report import report_of
from tests.passes.remote import inprocess_server as ps
from tests.passes.remote.inprocess_server import STORE, fetch, push

PASSES = ["split_remote", "hoist_issue", "sink_wait"]


@pytest.fixture(autouse=True)
def _fresh_store() -> None:
    STORE.reset()


def _order(gm: torch.fx.GraphModule) -> list[str]:
    return [n.name for n in gm.graph.nodes]


class FetchEarly(nn.Module):
    """Rows fetched first but needed only after the dense tower."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(ps.DIM, ps.DIM)
        self.fc2 = nn.Linear(ps.DIM, ps.DIM)

    def forward(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        a = fetch("t0", ids)
        b = fetch("t2", ids)
        h = self.fc2(torch.relu(self.fc1(x)))
        return torch.cat([h * a, b], dim=1)


def _inputs() -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(3, ps.DIM), torch.tensor([1, 2, 3])


def test_wait_moves_to_just_before_its_first_user() -> None:
    gm = distopt.optimize(FetchEarly(), _inputs(), passes=PASSES, strict=True)
    order = _order(gm)
    assert order.index("fetch_wait") == order.index("mul") - 1
    assert order.index("fetch_1_wait") == order.index("cat") - 1
    assert order.index("fc2") < order.index("fetch_wait")


class PushThenRead(nn.Module):
    def forward(self, x: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, ...]:
        push("t0", ids, x)
        y = torch.tanh(x) * 2
        z = torch.sigmoid(y)
        return z, fetch("t0", ids)


def test_write_wait_sinks_only_to_the_next_conflicting_call() -> None:
    # Without hoisting, the read stays after the local work (hoisting would move it up to the
    # write's wait instead, which hides the same latency).
    passes = ["split_remote", "sink_wait"]
    gm = distopt.optimize(PushThenRead(), _inputs(), passes=passes, verify=False, strict=True)
    order = _order(gm)
    assert order.index("push_wait") == order.index("fetch_issue") - 1
    assert order.index("sigmoid") < order.index("push_wait")


class PushOnly(nn.Module):
    def forward(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        push("t1", ids, x)
        return torch.tanh(x) + 1


def test_unused_write_wait_sinks_to_the_end_and_is_kept() -> None:
    gm = distopt.optimize(PushOnly(), _inputs(), passes=PASSES, strict=True)
    order = _order(gm)
    assert order[-2] == "push_wait" and order[-1] == "output"
    # Verification would have to apply the push: it is skipped and says why.
    verification = report_of(gm).verification
    assert verification is not None and verification.skipped is not None
    assert "writes to remote state" in verification.skipped and "push(" in verification.skipped
    assert STORE.versions["t1"] == 0
    gm(*_inputs())
    assert STORE.versions["t1"] == 1


def test_verification_applies_a_remote_write_once_when_allowed() -> None:
    config = {"verify": {"remote_writes": True}}
    gm = distopt.optimize(PushOnly(), _inputs(), passes=PASSES, strict=True, config=config)
    verification = report_of(gm).verification
    assert verification is not None and verification.passed and verification.skipped is None
    # The original's run applied the push; the optimized run replayed it.
    assert STORE.versions["t1"] == 1


class InPlaceAfter(nn.Module):
    def forward(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        rows = fetch("t0", ids)
        buf = x.clone()
        buf.mul_(2)
        return buf + rows


def test_wait_does_not_sink_past_an_in_place_op() -> None:
    gm = distopt.optimize(InPlaceAfter(), _inputs(), passes=PASSES, strict=True)
    order = _order(gm)
    assert order.index("fetch_wait") < order.index("mul_")


class SharedUser(nn.Module):
    def forward(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        a = fetch("t0", ids)
        b = fetch("t1", ids)
        c = fetch("t2", ids)
        h = torch.tanh(x)
        return torch.cat([h, a, b, c], dim=1)


def test_waits_meeting_at_one_user_keep_their_order_and_sink_is_idempotent() -> None:
    gm = distopt.optimize(SharedUser(), _inputs(), passes=PASSES, strict=True)
    waits = [name for name in _order(gm) if name.endswith("_wait")]
    assert waits == ["fetch_wait", "fetch_1_wait", "fetch_2_wait"]
    assert _order(gm).index("tanh") < _order(gm).index("fetch_wait")
    code = gm.code
    record = run_passes(gm, resolve_pipeline(PASSES))
    assert gm.code == code
    assert not any(p.modified for p in record.passes)
