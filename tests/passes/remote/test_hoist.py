import pytest
import torch
from torch import nn

import distopt
from distopt.passes import run_passes
from distopt.passes.core.pass_base import resolve_pipeline
from tests.passes.remote import inprocess_server as ps
from tests.passes.remote.inprocess_server import STORE, fetch, push

PASSES = ["split_remote", "hoist_issue"]


@pytest.fixture(autouse=True)
def _fresh_store() -> None:
    STORE.reset()


def _order(gm: torch.fx.GraphModule) -> list[str]:
    return [n.name for n in gm.graph.nodes]


def _before(gm: torch.fx.GraphModule, first: str, second: str) -> bool:
    order = _order(gm)
    return order.index(first) < order.index(second)


class Tower(nn.Module):
    """A fetch written after dense work, with ids sliced from an input."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(ps.DIM, ps.DIM)
        self.fc2 = nn.Linear(ps.DIM, ps.DIM)

    def forward(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        h = self.fc2(torch.relu(self.fc1(x)))
        rows = fetch("t0", ids[:, 0] + 1)
        return h * rows


def _inputs() -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(3, ps.DIM), torch.tensor([[1, 2], [3, 4], [5, 6]])


def test_issue_and_its_ids_move_above_the_dense_work() -> None:
    gm = distopt.optimize(Tower(), _inputs(), passes=PASSES, strict=True)
    lines = [line.strip() for line in gm.code.strip().splitlines()[1:]]
    assert lines[0].startswith("getitem = ids[")
    assert lines[1].startswith("add = getitem + 1")
    assert lines[2].startswith("fetch_issue = ")
    assert lines[3].startswith("fc1 = self.fc1(x)")
    # The wait has not moved (sinking is another pass).
    assert _before(gm, "fc2", "fetch_wait")


class ReadAfterWrite(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(ps.DIM, ps.DIM)

    def forward(self, x: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, ...]:
        h = self.fc(x)
        push("t0", ids, h)
        same = fetch("t0", ids)  # must see the push
        other = fetch("t1", ids)  # independent of the push
        return same, other


def test_read_never_moves_above_a_conflicting_write() -> None:
    ids = torch.tensor([1, 2, 3])
    gm = distopt.optimize(
        ReadAfterWrite(), (torch.randn(3, ps.DIM), ids), passes=PASSES, verify=False, strict=True
    )
    assert _before(gm, "push_wait", "fetch_issue")
    assert _before(gm, "fetch_1_issue", "fc")  # the other table's read goes first


def test_read_after_write_still_sees_the_write() -> None:
    model, x, ids = ReadAfterWrite(), torch.randn(3, ps.DIM), torch.tensor([1, 2, 3])
    expected = model(x, ids)
    STORE.reset()
    gm = distopt.optimize(model, (x, ids), passes=PASSES, verify=False, strict=True)
    for got, want in zip(gm(x, ids), expected, strict=True):
        torch.testing.assert_close(got, want)


class TwoWrites(nn.Module):
    def forward(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        y = torch.tanh(x)
        push("t0", ids, y)
        z = torch.sigmoid(x)
        push("t1", ids, z)
        return y + z


def test_writes_keep_their_relative_order() -> None:
    ids = torch.tensor([0, 1, 2])
    gm = distopt.optimize(TwoWrites(), (torch.randn(3, ps.DIM), ids), passes=PASSES, strict=True)
    assert _before(gm, "push_issue", "push_1_issue")
    # The second write (another table) is issued before the first one completes.
    assert _before(gm, "push_1_issue", "push_wait")


class InPlace(nn.Module):
    def forward(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        buf = ids.clone()
        buf.add_(1)  # ids of the fetch below change here
        return fetch("t0", buf) * x


def test_issue_stays_below_an_in_place_update_of_its_inputs() -> None:
    ids = torch.tensor([0, 1, 2])
    gm = distopt.optimize(InPlace(), (torch.randn(3, ps.DIM), ids), passes=PASSES, strict=True)
    assert _before(gm, "add_", "fetch_issue")


class DependentFetch(nn.Module):
    """The second fetch's ids come from the first fetch's rows."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(ps.DIM, ps.DIM)

    def forward(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        first = fetch("t0", ids)
        h = self.fc(x)
        second_ids = (first[:, 0].abs() * 10).long()
        second = fetch("t1", second_ids)
        return h + second


def test_issue_waits_for_the_value_its_ids_depend_on() -> None:
    ids = torch.tensor([0, 1, 2])
    gm = distopt.optimize(
        DependentFetch(), (torch.randn(3, ps.DIM), ids), passes=PASSES, strict=True
    )
    assert _before(gm, "fetch_wait", "fetch_1_issue")
    # Its ids computation is hoisted no higher than the wait allows, right before its issue.
    assert _order(gm).index("fetch_1_issue") == _order(gm).index("long") + 1


class RandomOps(nn.Module):
    def forward(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        noise = torch.rand_like(x)
        jitter = torch.randint_like(ids, 0, 2)
        rows = fetch("t0", ids + jitter)
        return noise + rows


def test_random_ops_keep_their_order() -> None:
    ids = torch.tensor([0, 1, 2])
    gm = distopt.optimize(RandomOps(), (torch.randn(3, ps.DIM), ids), passes=PASSES, strict=True)
    assert _before(gm, "rand_like", "randint_like")  # the RNG stream is consumed as written


def test_hoist_is_idempotent() -> None:
    gm = distopt.optimize(Tower(), _inputs(), passes=PASSES, strict=True)
    code = gm.code
    record = run_passes(gm, resolve_pipeline(["hoist_issue"]))
    assert gm.code == code and not record.passes[0].modified
