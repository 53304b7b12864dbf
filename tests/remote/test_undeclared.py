"""A model whose ``rpc_sync`` runs a server function nobody declared: distopt counts it a write,
so it never sends it twice and cannot verify the model. The user is told once, at optimize time,
which function, where, and which decorator to add; the report and ``distopt explain`` say it too."""

from __future__ import annotations

import inspect
import warnings

import pytest
import torch
import torch.distributed.rpc as rpc
from torch import nn

import distopt
from distopt.report import report_of
from tests.remote.corpus import common, tables
from tests.remote.corpus.group import rpc_group

pytestmark = pytest.mark.slow


class Counting(nn.Module):
    """Looks rows up, then counts the lookups on the server with an undeclared function."""

    def __init__(self, counter=tables.count_lookups) -> None:
        super().__init__()
        self.counter = counter
        self.tower = common.tower(hidden=32)
        self.head = common.head()

    def forward(self, dense, ids):
        e0 = rpc.rpc_sync("ps0", tables.lookup_rows, args=("t0", ids[:, 0]))
        rpc.rpc_sync("ps0", self.counter, args=("t0", ids.shape[0]))
        e1 = rpc.rpc_sync("ps1", tables.lookup_rows, args=("t1", ids[:, 1]))
        return self.head(torch.cat([self.tower(dense), e0, e1], dim=1))


@pytest.fixture(scope="module")
def group():
    distopt.register_read(tables.lookup_rows)
    with rpc_group(2) as servers:
        for i, server in enumerate(servers):
            rpc.rpc_sync(server, tables.create_table, args=(f"t{i}", i))
        yield servers


def _line(fn, text: str) -> str:
    """``file:line: code`` of the line of ``fn``'s source that holds ``text``."""
    lines, first = inspect.getsourcelines(fn)
    index = next(i for i, line in enumerate(lines) if text in line)
    return f"{inspect.getsourcefile(fn)}:{first + index}: {lines[index].strip()}"


def test_the_user_is_told_once_which_function_to_declare(group) -> None:
    model, inputs = common.seeded(0, Counting()), common.inputs()
    with pytest.warns(distopt.DistoptUnverifiedWarning) as caught:
        optimized = distopt.optimize(model, inputs)
    (warning,) = caught
    code = tables.count_lookups.__code__
    expected = (
        f"distopt: Counting is returned unverified: it sends rpc_sync of count_lookups (defined at "
        f"{code.co_filename}:{code.co_firstlineno}) at {_line(Counting.forward, 'self.counter')}; "
        "count_lookups is declared neither a read nor a write, so distopt counts it a write and never "
        "sends it twice: decorate it with @distopt.register_read if it only reads server state (then "
        "it is verified), or @distopt.register_write if it writes (config verify.remote_writes=true "
        "then lets verification apply it once)"
    )
    assert str(warning.message) == expected
    assert warning.filename == __file__  # the user's own call of distopt.optimize
    record = report_of(optimized).verification
    assert record is not None and record.compared == 0
    assert record.skipped == expected.split(" is returned unverified: it sends ", 1)[1].replace(
        "rpc_sync of", "the model writes to remote state (rpc_sync of", 1
    ).replace("; count_lookups", "); count_lookups", 1)
    text = distopt.explain(optimized, show_code=False)
    assert f"verification skipped: {record.skipped}" in text
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per function: not again
        distopt.optimize(model, inputs)


def test_declared_a_read_it_is_verified(group) -> None:
    distopt.register_read(tables.read_count)
    model, inputs = common.seeded(0, Counting(counter=tables.read_count)), common.inputs()
    with warnings.catch_warnings():
        warnings.simplefilter("error", distopt.DistoptUnverifiedWarning)
        optimized = distopt.optimize(model, inputs)
    record = report_of(optimized).verification
    assert record is not None and record.passed and record.skipped is None and record.gradients
