"""Regional compilation: repeated blocks found, compiled once per distinct structure, in parallelize."""

from __future__ import annotations

from typing import Any

import torch
import torch._dynamo
import torch.multiprocessing as mp
from torch import nn

import distopt
from distopt.dist.rendezvous import StorePlan, init_gloo, spawned_gloo
from distopt.models import build, make_inputs
from distopt.parallel import apply_ddp, timing_of
from distopt.parallel.regions import compile_regions, repeated_blocks


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm, self.fc = nn.LayerNorm(dim), nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.relu(self.fc(self.norm(x)))


class Stages(nn.Module):
    """Two stages of different widths, ``depth`` identical blocks each (a conv net's shape)."""

    def __init__(self, depth: int) -> None:
        super().__init__()
        self.stem = nn.Linear(4, 8)
        self.stages = nn.ModuleList(
            [
                nn.Sequential(*[Block(8) for _ in range(depth)]),
                nn.Sequential(nn.Linear(8, 16), *[Block(16) for _ in range(depth)]),
            ]
        )
        self.head = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.stem(x)
        for stage in self.stages:
            h = stage(h)
        return self.head(h)


def test_regions_are_the_repeated_blocks_inside_distinct_stages() -> None:
    paths = [path for path, _ in repeated_blocks(Stages(depth=2))]
    assert paths == ["stages.0.0", "stages.0.1", "stages.1.1", "stages.1.2"]  # not the Linear


def test_gpt_regions_are_its_blocks() -> None:
    model = build("gpt", vocab_size=64, dim=32, heads=2, layers=3, seq_len=16, dropout=0.0)
    assert [path for path, _ in repeated_blocks(model)] == ["blocks.0", "blocks.1", "blocks.2"]


def test_compiles_grow_with_distinct_blocks_not_depth() -> None:
    compiled: list[int] = []

    def counting(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        compiled.append(len(gm.graph.nodes))
        return gm.forward

    counts = []
    for depth in (2, 6):
        torch._dynamo.reset()
        compiled.clear()
        model = Stages(depth)
        compile_regions([block for _, block in repeated_blocks(model)], backend=counting)
        x = torch.randn(3, 4, requires_grad=True)
        model(x).sum().backward()
        model(x).sum().backward()
        counts.append(len(compiled))
    # One graph per distinct block (widths 8 and 16), at any depth.
    assert counts == [2, 2]


class ConvBlock(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.dw = nn.Conv2d(channels, channels, 3, padding=1, groups=channels)
        self.pw = nn.Conv2d(channels, channels, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.pw(torch.relu(self.dw(x)))


class Pyramid(nn.Module):
    """A conv net's stages: the second is twice as wide on a quarter of the pixels."""

    def __init__(self) -> None:
        super().__init__()
        self.stages = nn.ModuleList(
            [nn.Sequential(ConvBlock(4), ConvBlock(4)), nn.Sequential(ConvBlock(8), ConvBlock(8))]
        )
        self.down = nn.Conv2d(4, 8, 2, stride=2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.stages[1](self.down(self.stages[0](x)))


def test_blocks_of_one_class_on_other_shapes_compile_static() -> None:
    # One block class on other widths and sizes: the second shape must not turn the later
    # blocks' graph dynamic (symbolic sizes: slower kernels to build and to run).
    sizes: list[list[Any]] = []

    def recording(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        values = [n.meta.get("example_value") for n in gm.graph.find_nodes(op="placeholder")]
        sizes.append([s for v in values if isinstance(v, torch.Tensor) for s in v.shape])
        return gm.forward

    torch._dynamo.reset()
    model = Pyramid()
    compile_regions([block for _, block in repeated_blocks(model)], backend=recording)
    model(torch.randn(2, 4, 8, 8, requires_grad=True)).sum().backward()
    assert len(sizes) == 2
    assert all(isinstance(s, int) for graph in sizes for s in graph)


def _worker(rank: int, plan: StorePlan, results: Any) -> None:
    torch.set_num_threads(1)
    graphs: list[str] = []

    def counting(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        graphs.append(gm.code)
        return gm.forward

    torch._dynamo.register_backend(counting, name="distopt_test_counting")
    init_gloo(plan, me="rank0", rank=0, world_size=1, timeout_s=60.0)
    try:
        torch.manual_seed(0)
        model = build("gpt", vocab_size=64, dim=32, heads=2, layers=4, seq_len=16, dropout=0.0)
        reference = build("gpt", vocab_size=64, dim=32, heads=2, layers=4, seq_len=16, dropout=0.0)
        reference.load_state_dict(model.state_dict())
        example = make_inputs("gpt", model, 2)
        ours = distopt.parallelize(
            model,
            "fsdp",
            example_inputs=example,
            compile=True,
            compile_backend="distopt_test_counting",
            min_unit_bytes=1,
        )
        (idx,) = example
        loss = ours(idx).float().square().mean()
        loss.backward()
        ref_loss = reference(idx).float().square().mean()
        record = timing_of(ours)
        block_graphs = sum("attn" in code for code in graphs)
        results.put(
            (
                record.regions if record else -1,
                block_graphs,
                len(graphs),
                float(loss),
                float(ref_loss),
                record.compiled if record else "",
            )
        )
    finally:
        import torch.distributed as dist

        dist.destroy_process_group()


def test_parallelize_compiles_each_repeated_block_once() -> None:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with spawned_gloo() as plan:
        mp.start_processes(_worker, args=(plan, results), nprocs=1, join=True, start_method="spawn")
    regions, block_graphs, graphs, loss, ref_loss, compiled = results.get(timeout=5)
    assert regions == 4 and block_graphs == 1, (regions, block_graphs)
    assert compiled == (
        "distopt_test_counting, 4 repeated blocks (blocks.0-3) as 1 distinct structure, each "
        "compiled once; units holding no block compiled whole"
    ), compiled
    assert graphs <= 3  # the block, and the units outside the blocks (final norm, head)
    assert abs(loss - ref_loss) < 1e-5


def _ddp_worker(rank: int, plan: StorePlan, results: Any) -> None:
    torch.set_num_threads(1)
    graphs: list[int] = []

    def counting(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        graphs.append(len(gm.graph.nodes))
        return gm.forward

    init_gloo(plan, me="rank0", rank=0, world_size=1, timeout_s=60.0)
    try:
        model = nn.Sequential(*[Block(512) for _ in range(3)])
        compile_regions([block for _, block in repeated_blocks(model)], backend=counting)
        # A block holds 1.05 MB: DDPOptimizer would split its graph at 1 MB buckets.
        ddp = apply_ddp(model, bucket_cap_mb=1)
        x = torch.randn(3, 512, requires_grad=True)  # as every block's input: one guard set
        for _ in range(2):
            ddp(x).sum().backward()
        results.put(len(graphs))
    finally:
        import torch.distributed as dist

        dist.destroy_process_group()


def test_under_ddp_each_region_is_one_graph() -> None:
    """Inside DDP's forward, Dynamo's DDPOptimizer splits a graph at DDP's bucket boundaries; a
    region's backward is its own graph already, so its compile is not split (issue 26: GPT's
    blocks were compiled as two graphs each under DDP's 25 MiB buckets)."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with spawned_gloo() as plan:
        mp.start_processes(
            _ddp_worker, args=(plan, results), nprocs=1, join=True, start_method="spawn"
        )
    assert results.get(timeout=5) == 1  # the block, once


def test_path_ranges_join_consecutive_numbered_siblings() -> None:
    from distopt.parallel.regions import path_ranges

    assert path_ranges([f"blocks.{i}" for i in range(4)]) == "blocks.0-3"
    assert path_ranges(["s.0.l.0", "s.0.l.1", "s.1.l.0", "head"]) == "s.0.l.0-1, s.1.l.0, head"
    assert path_ranges(["a.0", "a.2", "a.3"]) == "a.0, a.2-3"
    assert path_ranges(["0", "1", "2"]) == "0-2"
