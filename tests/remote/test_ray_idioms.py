"""The remote-call passes on models written as Ray users write them: ``ray.get(h.m.remote(x))``.

One local Ray instance on 127.0.0.1 for the module. The models below use no distopt API; the
reads are declared once, as a user would, outside the models.
"""

from __future__ import annotations

import subprocess
import sys
import warnings

import pytest
import torch
import torch.fx
from torch import nn

import distopt
from distopt.remote.ops import remote_ops
from distopt.report import report_of
from tests.remote.schedule import schedule

ray = pytest.importorskip("ray")

pytestmark = pytest.mark.slow

DIM, ROWS, DENSE = 8, 50, 16


@ray.remote
class EmbeddingServer:
    def __init__(self, seed: int) -> None:
        self.table = torch.randn(ROWS, DIM, generator=torch.Generator().manual_seed(seed))
        self.bumps = 0

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        return self.table[ids].sum(1) + self.bumps

    def lookup_many(self, calls: list) -> list:
        return [self.lookup(*args) for args in calls]

    def bump(self) -> int:
        self.bumps += 1
        return self.bumps


@ray.remote
def lookup_task(table: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return table[ids].sum(1)


@ray.remote
def gather(table: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return table[ids].sum(1)


@ray.remote
def gather_many(calls: list) -> list:
    # Object refs nested in the argument tuples arrive as refs (Ray resolves top-level ones only).
    return [ray.get(table)[ids].sum(1) for table, ids in calls]


distopt.register_read(EmbeddingServer.lookup)
distopt.register_read(gather)
distopt.register_batched(gather, gather_many)
distopt.register_read(lookup_task)
# Only SameActorModel makes concurrent reads of one actor; the others are not batched.
distopt.register_batched(EmbeddingServer.lookup, EmbeddingServer.lookup_many)


def _tower() -> nn.Sequential:
    return nn.Sequential(nn.Linear(DENSE, 32), nn.ReLU(), nn.Linear(32, DIM))


class ActorModel(nn.Module):
    def __init__(self, servers) -> None:
        super().__init__()
        self.emb0, self.emb1 = servers
        self.tower = _tower()
        self.head = nn.Linear(3 * DIM, 1)

    def forward(self, dense, ids):
        h = self.tower(dense)
        e0 = ray.get(self.emb0.lookup.remote(ids[:, 0]))
        e1 = ray.get(self.emb1.lookup.remote(ids[:, 1]))
        return self.head(torch.cat([h, e0, e1], dim=1))


class TaskModel(ActorModel):
    def __init__(self, tables) -> None:
        nn.Module.__init__(self)
        self.t0, self.t1 = (ray.put(t) for t in tables)
        self.tower = _tower()
        self.head = nn.Linear(3 * DIM, 1)

    def forward(self, dense, ids):
        h = self.tower(dense)
        e0 = ray.get(lookup_task.remote(self.t0, ids[:, 0]))
        e1 = ray.get(lookup_task.remote(self.t1, ids[:, 1]))
        return self.head(torch.cat([h, e0, e1], dim=1))


class BatchedTaskModel(TaskModel):
    def forward(self, dense, ids):
        h = self.tower(dense)
        e0 = ray.get(gather.remote(self.t0, ids[:, 0]))
        e1 = ray.get(gather.remote(self.t1, ids[:, 1]))
        return self.head(torch.cat([h, e0, e1], dim=1))


class ListGetModel(ActorModel):
    """Both reads issued first (one with options) and waited for by one ``ray.get`` of the list."""

    def forward(self, dense, ids):
        refs = [
            self.emb0.lookup.options(name="e0").remote(ids[:, 0]),
            self.emb1.lookup.remote(ids[:, 1]),
        ]
        h = self.tower(dense)
        e0, e1 = ray.get(refs)
        return self.head(torch.cat([h, e0, e1], dim=1))


class WriteModel(ActorModel):
    """A read, a write and a read of one actor, a read of the other: the write stays between."""

    def forward(self, dense, ids):
        h = self.tower(dense)
        e0 = ray.get(self.emb0.lookup.remote(ids[:, 0]))
        ray.get(self.emb0.bump.remote())
        e2 = ray.get(self.emb0.lookup.remote(ids[:, 1]))
        e1 = ray.get(self.emb1.lookup.remote(ids[:, 1]))
        return self.head(torch.cat([h, e0 + e2, e1], dim=1))


class SameActorModel(ActorModel):
    """Two reads of one actor: batched into one ``lookup_many`` request once declared."""

    def forward(self, dense, ids):
        h = self.tower(dense)
        e0 = ray.get(self.emb0.lookup.remote(ids[:, 0]))
        e1 = ray.get(self.emb0.lookup.remote(ids[:, 1]))
        return self.head(torch.cat([h, e0, e1], dim=1))


@pytest.fixture(scope="module")
def servers():
    from distopt.ps.cluster.ray_backend import ensure_ray
    from distopt.ps.spec import ServerOptions

    ensure_ray("local", ServerOptions(backend="ray"))  # as a job's private instance: on 127.0.0.1
    try:
        yield EmbeddingServer.remote(0), EmbeddingServer.remote(1)
    finally:
        ray.shutdown()


def _inputs(batch: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    return torch.randn(batch, DENSE, generator=gen), torch.randint(
        0, ROWS, (batch, 2, 4), generator=gen
    )


def _optimize(model: nn.Module, inputs, **config) -> torch.fx.GraphModule:
    with warnings.catch_warnings():
        warnings.simplefilter("error", distopt.DistoptFallbackWarning)
        gm = distopt.optimize(model, inputs, config=config or None)
    report = report_of(gm)
    assert isinstance(gm, torch.fx.GraphModule) and report.tier == "symbolic_trace", report.fallback
    return gm


@pytest.mark.parametrize(
    "build", [ActorModel, TaskModel, ListGetModel], ids=["actor", "task", "list"]
)
def test_reads_are_issued_before_the_tower_and_waited_after_it(servers, build) -> None:
    torch.manual_seed(0)
    args = servers if build is not TaskModel else [torch.randn(ROWS, DIM) for _ in range(2)]
    model, inputs = build(args), _inputs()
    gm = _optimize(model, inputs)
    verification = report_of(gm).verification
    assert verification.passed and verification.skipped is None, verification
    issues, waits, tower = schedule(gm)
    assert len(issues) == 2 and len(waits) == 2, gm.code
    assert max(issues) < min(tower) and min(waits) > max(tower), gm.code
    torch.testing.assert_close(gm(*inputs), model(*inputs), rtol=0, atol=0)


def test_a_write_keeps_its_place_among_reads_of_its_actor(servers) -> None:
    torch.manual_seed(0)
    model, inputs = WriteModel(servers), _inputs()
    gm = _optimize(model, inputs)
    skipped = report_of(gm).verification.skipped
    assert skipped is not None and "self.emb0.bump.remote()" in skipped  # not run twice unasked
    gm = _optimize(model, inputs, verify={"remote_writes": True})
    assert report_of(gm).verification.passed
    ops = remote_ops(gm.graph)
    nodes = list(gm.graph.nodes)
    position = nodes.index
    starts = [n for n, op in ops.items() if n is op.start]
    (write,) = [n for n in starts if ops[n].is_write]
    same = sorted(
        (n for n in starts if not ops[n].is_write and ops[n].resources == ops[write].resources),
        key=position,
    )
    (other,) = [n for n in starts if ops[n].resources != ops[write].resources]
    first, second = same
    assert position(ops[first].ends[0]) < position(write), gm.code  # read done, then the write
    assert position(ops[write].ends[0]) < position(second), gm.code  # write done, then the read
    assert position(other) < min(schedule(gm)[2]), gm.code  # the other actor's read overlaps
    # The first read sees the count before the write, the second after it.
    out = gm(*inputs)
    dense, ids = inputs
    lookup = lambda server, ids: ray.get(server.lookup.remote(ids))  # noqa: E731
    e0, e2 = lookup(servers[0], ids[:, 0]) - 1, lookup(servers[0], ids[:, 1])
    with torch.no_grad():
        expected = model.head(
            torch.cat([model.tower(dense), e0 + e2, lookup(servers[1], ids[:, 1])], 1)
        )
    torch.testing.assert_close(out.detach(), expected)


@pytest.mark.parametrize("build", [SameActorModel, BatchedTaskModel], ids=["actor", "task"])
def test_concurrent_reads_with_a_batched_variant_become_one_request(servers, build) -> None:
    torch.manual_seed(0)
    args = servers if build is SameActorModel else [torch.randn(ROWS, DIM) for _ in range(2)]
    model, inputs = build(args), _inputs()
    gm = _optimize(model, inputs)
    assert report_of(gm).verification.passed
    issues, waits, tower = schedule(gm)
    assert len(issues) == 1 and len(waits) == 2, gm.code
    assert "ray_remote_many" in gm.code
    assert max(issues) < min(tower) and min(waits) > max(tower), gm.code
    torch.testing.assert_close(gm(*inputs), model(*inputs), rtol=0, atol=0)


@ray.remote
class MisdeclaredServer:
    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        return ids.float()

    def lookup_many(self, calls: list, scale: float) -> list:
        return [scale * self.lookup(*args) for args in calls]


@ray.remote
def misdeclared_many(tables: list, ids: list) -> list:
    return []


def test_a_batched_variant_that_cannot_take_the_calls_is_a_one_line_error() -> None:
    expected = (
        r"^register_batched: lookup_many\(self, calls, scale\) must take one "
        r"argument after self, the list of the calls' argument tuples$"
    )
    with pytest.raises(distopt.ConfigError, match=expected):
        distopt.register_batched(MisdeclaredServer.lookup, MisdeclaredServer.lookup_many)
    expected = (
        r"^register_batched: misdeclared_many\(tables, ids\) must take one "
        r"argument, the list of the calls' argument tuples$"
    )
    with pytest.raises(distopt.ConfigError, match=expected):
        distopt.register_batched(gather, misdeclared_many)


def test_distopt_imports_without_ray() -> None:
    code = "import sys; sys.modules['ray'] = None; import distopt; print(distopt.register_batched)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize("staleness", [0, 1])
def test_a_pipeline_prefetches_the_actor_reads_a_step_ahead(servers, staleness) -> None:
    from distopt.pipeline import TrainPipeline, pipeline_split

    batches = [(*_inputs(), torch.rand(8, 1)) for _ in range(4)]

    def build() -> torch.fx.GraphModule:
        torch.manual_seed(0)
        return _optimize(ActorModel(servers), _inputs())

    assert len(pipeline_split(build()).slots) == 2
    gm, expected = build(), []
    optimizer = torch.optim.SGD(gm.parameters(), lr=0.1)
    for dense, ids, target in batches:
        optimizer.zero_grad()
        loss = nn.functional.binary_cross_entropy_with_logits(gm(dense, ids), target)
        loss.backward()
        optimizer.step()
        expected.append(loss.item())
    gm = build()
    pipe = TrainPipeline(
        gm,
        torch.optim.SGD(gm.parameters(), lr=0.1),
        iter(batches),
        staleness=staleness,
        inputs=lambda b: b[:2],
        loss_fn=lambda out, b: nn.functional.binary_cross_entropy_with_logits(out, b[2]),
    )
    assert [out.loss.item() for out in pipe.run()] == expected  # the actors are only read
    pipe.close()
