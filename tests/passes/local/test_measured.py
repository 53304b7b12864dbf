"""Machine-dependent rewrites are kept only where measured faster; the report gives both timings.

The clock is injected (``Measurer(clock=...)``): the verdict is tested without timing anything.
"""

from __future__ import annotations

import contextlib
import re
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.fx
from torch import nn

from distopt.estimate import ab
from distopt.estimate.ab import Measurer
from distopt.passes import PassContext
from distopt.passes.core.pass_base import CAPTURED, measured_seconds, timing_key
from distopt.passes.local import measured
from distopt.passes.local.channels_last import channels_last, to_channels_last
from distopt.passes.local.fused import FusedConv2d
from distopt.passes.local.measured import CONTAINER, answering_first_call
from distopt.passes.local.mkldnn_fusion import mkldnn_fusion
from distopt.remote.isolation import preserved_state
from tests.estimate.test_ab import clock_of


class ConvRelu(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.conv(x))


def fixed(baseline: float, candidate: float) -> Measurer:
    """A measurer whose clock says each call of the baseline/candidate takes these seconds."""

    def clock(label: str, fn: Callable[[], object]) -> float:
        return {"baseline": baseline, "candidate": candidate}[label]

    return Measurer(clock=clock)


def _eval_ctx(measurer: Measurer | None, **options: object) -> PassContext:
    return PassContext(
        example_inputs=(torch.randn(2, 3, 8, 8),), training=False, measure=measurer, options=options
    )


def test_a_rewrite_measured_slower_is_declined_with_both_timings() -> None:
    gm = torch.fx.symbolic_trace(ConvRelu().eval())
    code = gm.code
    result = channels_last(gm, _eval_ctx(fixed(0.010, 0.012)))
    gm.recompile()
    assert not result.modified and gm.code == code
    assert result.detail.startswith("declined") and "with 12 ms vs without 10 ms" in result.detail


def test_a_rewrite_measured_faster_is_kept() -> None:
    gm = torch.fx.symbolic_trace(ConvRelu().eval())
    result = channels_last(gm, _eval_ctx(fixed(0.010, 0.008)))
    assert result.modified and "kept: measured with 8 ms vs without 10 ms" in result.detail
    assert to_channels_last in [n.target for n in gm.graph.nodes]


def test_a_declined_fusion_leaves_no_modules_behind() -> None:
    gm = torch.fx.symbolic_trace(ConvRelu().eval())
    result = mkldnn_fusion(gm, _eval_ctx(fixed(0.010, 0.020)))
    assert not result.modified and not hasattr(gm, CONTAINER)
    assert [n.op for n in gm.graph.nodes] == [
        "placeholder",
        "call_module",
        "call_function",
        "output",
    ]


def test_measure_false_applies_unmeasured() -> None:
    gm = torch.fx.symbolic_trace(ConvRelu().eval())
    result = channels_last(gm, _eval_ctx(fixed(0.010, 0.020), measure=False))
    assert result.modified and "not measured" in result.detail


def test_without_inputs_or_measurer_nothing_is_applied() -> None:
    gm = torch.fx.symbolic_trace(ConvRelu().eval())
    no_inputs = PassContext(training=False, measure=fixed(0.01, 0.001))
    assert "no example inputs" in channels_last(gm, no_inputs).detail
    assert "measuring is off" in channels_last(gm, _eval_ctx(None)).detail
    assert not hasattr(gm, CONTAINER) and to_channels_last not in [n.target for n in gm.graph.nodes]


def test_training_graphs_get_layouts_only_on_request() -> None:
    gm = torch.fx.symbolic_trace(ConvRelu())
    ctx = PassContext(
        example_inputs=(torch.randn(2, 3, 8, 8),), training=True, measure=fixed(0.01, 0.001)
    )
    result = channels_last(gm, ctx)
    assert not result.modified and "training mode" in result.detail


def test_a_graph_timed_by_one_pass_is_not_timed_again_by_the_next() -> None:
    calls: list[str] = []
    gm = torch.fx.symbolic_trace(ConvRelu().eval())
    ctx = _eval_ctx(Measurer(clock=clock_of({"baseline": 1.0, "candidate": 1.5}, calls)))
    assert not mkldnn_fusion(gm, ctx).modified  # declined: the graph is as it was
    assert measured_seconds(gm, ctx.example_inputs or ()) == 1.0
    assert measured_seconds(gm, (torch.randn(4, 3, 8, 8),)) is None  # timed on other shapes
    calls.clear()
    assert not channels_last(gm, ctx).modified
    assert calls == ["candidate"]  # its "without" is the graph mkldnn_fusion timed


def test_packing_weights_on_first_use_is_left_out_of_the_timing() -> None:
    gm = torch.fx.symbolic_trace(ConvRelu().eval())
    x = torch.randn(2, 3, 8, 8)
    mkldnn_fusion(gm, _eval_ctx(None, measure=False))
    gm.recompile()
    (fused,) = [m for m in gm.modules() if isinstance(m, FusedConv2d)]
    marked: list[bool] = []
    derive = fused.packed.get

    def watched(*args: Any, **kwargs: Any) -> Any:
        timing = ab._TIMING.get()
        before = timing.left_out_s if timing is not None else None
        out = derive(*args, **kwargs)
        marked.append(timing is not None and timing.left_out_s > (before or 0.0))
        return out

    fused.packed.get = watched  # type: ignore[method-assign]
    with torch.no_grad():
        ab.wall_clock("candidate", lambda: gm(x))
        ab.wall_clock("candidate", lambda: gm(x))
    assert marked == [True, False]  # packed once, on the first call, and left out of its time


def test_the_graph_as_captured_takes_the_original_models_run_as_its_first_sample() -> None:
    # distopt.optimize's verification run timed the original (1 s here); the first measured pass
    # on the graph as captured starts from it: a clear first round costs one call, not two.
    calls: list[str] = []
    gm = torch.fx.symbolic_trace(ConvRelu().eval())
    ctx = _eval_ctx(Measurer(clock=clock_of({"baseline": 1.0, "candidate": 0.5}, calls)))
    gm.meta[CAPTURED] = (timing_key(gm, ctx.example_inputs or ()), 1.0)
    result = mkldnn_fusion(gm, ctx)
    assert result.modified and "with 500 ms vs without 1.00 s (median of 1" in result.detail
    assert calls == ["candidate"]


def test_the_original_models_run_is_not_the_graphs_own_median() -> None:
    # Declined on the original's run alone, the graph (as captured again) has no timing of its
    # own: the final check must time it rather than compare the original with itself.
    gm = torch.fx.symbolic_trace(ConvRelu().eval())
    ctx = _eval_ctx(fixed(1.0, 1.5))
    gm.meta[CAPTURED] = (timing_key(gm, ctx.example_inputs or ()), 1.0)
    assert not mkldnn_fusion(gm, ctx).modified
    assert measured_seconds(gm, ctx.example_inputs or ()) is None


def _calling(baseline: float, candidate: float) -> Measurer:
    """A measurer that runs each call and says it took these seconds."""

    def clock(label: str, fn: Callable[[], object]) -> float:
        fn()
        return {"baseline": baseline, "candidate": candidate}[label]

    return Measurer(clock=clock)


def _counted_forward(gm: torch.fx.GraphModule) -> tuple[Callable[..., Any], list[int]]:
    count = [0]

    def forward(*args: Any) -> Any:
        count[0] += 1
        return gm.forward(*args)

    return forward, count


def test_the_first_call_on_the_timed_tensors_returns_the_timed_calls_outputs() -> None:
    gm = torch.fx.symbolic_trace(ConvRelu().eval())
    ctx = _eval_ctx(_calling(1.0, 0.5))
    x = (ctx.example_inputs or ())[0]
    assert mkldnn_fusion(gm, ctx).modified
    gm.recompile()
    forward, count = _counted_forward(gm)
    call = answering_first_call(gm, (x,), forward)
    with torch.no_grad():
        expected = gm(x)
        first, second = call(x), call(x)
    assert count[0] == 1  # the first call was answered, the second computed
    torch.testing.assert_close(first, expected)
    torch.testing.assert_close(second, expected)


def test_an_input_changed_since_the_timed_call_is_computed_anew() -> None:
    gm = torch.fx.symbolic_trace(ConvRelu().eval())
    ctx = _eval_ctx(_calling(1.0, 0.5))
    x = (ctx.example_inputs or ())[0]
    assert mkldnn_fusion(gm, ctx).modified
    gm.recompile()
    x.mul_(2)
    forward, count = _counted_forward(gm)
    with torch.no_grad():
        out = answering_first_call(gm, (x,), forward)(x)
        torch.testing.assert_close(out, gm(x))
    assert count[0] == 1


class _Counting(nn.Module):
    """Counts its calls in a tensor it is given (as a Dynamo graph is given the model's buffers):
    a timed call's outputs do not stand for a call, which must count."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)

    def forward(self, x: torch.Tensor, calls: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.conv(x)) + calls.add_(1) * 0


def test_a_call_that_writes_an_input_is_not_answered_from_a_timed_call() -> None:
    gm = torch.fx.symbolic_trace(_Counting().eval())
    x, calls = torch.randn(2, 3, 8, 8), torch.zeros(())
    ctx = PassContext(example_inputs=(x, calls), training=False, measure=_calling(1.0, 0.5))
    assert mkldnn_fusion(gm, ctx).modified
    gm.recompile()
    before = float(calls)
    forward, count = _counted_forward(gm)
    with torch.no_grad():
        answering_first_call(gm, (x, calls), forward)(x, calls)
    assert count[0] == 1 and float(calls) == before + 1


def test_a_call_with_grad_is_not_answered_from_a_timed_call() -> None:
    # The timed call ran without grad: no autograd history, and the fused module took its
    # inference kernel. A call with grad on computes its own outputs.
    gm = torch.fx.symbolic_trace(ConvRelu().eval())
    ctx = _eval_ctx(_calling(1.0, 0.5))
    x = (ctx.example_inputs or ())[0]
    assert mkldnn_fusion(gm, ctx).modified
    gm.recompile()
    forward, count = _counted_forward(gm)
    out = answering_first_call(gm, (x,), forward)(x)
    assert count[0] == 1 and out.grad_fn is not None


class _Noisy(nn.Module):
    """Draws random numbers (and adds nothing of them): a call moves the user's generator on."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.conv(x))
        return y + torch.rand_like(y) * 0


def test_a_call_that_draws_random_numbers_is_not_answered_from_a_timed_call() -> None:
    gm = torch.fx.symbolic_trace(_Noisy().eval())
    ctx = _eval_ctx(_calling(1.0, 0.5))
    x = (ctx.example_inputs or ())[0]
    assert mkldnn_fusion(gm, ctx).modified
    gm.recompile()
    forward, count = _counted_forward(gm)
    with torch.no_grad():
        start = torch.random.get_rng_state()
        gm(x)
        after_a_call = torch.random.get_rng_state()
        torch.random.set_rng_state(start)
        answering_first_call(gm, (x,), forward)(x)
    assert count[0] == 1 and torch.equal(torch.random.get_rng_state(), after_a_call)


class IdentityThenConv(nn.Module):
    """transformers' ResNet keeps ``nn.Identity`` shortcuts that remove_identity drops first."""

    def __init__(self) -> None:
        super().__init__()
        self.shortcut = nn.Identity()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.conv(self.shortcut(x)))


def test_removing_no_op_calls_keeps_the_captured_sample_and_other_rewrites_drop_it() -> None:
    from distopt.passes import resolve_pipeline, run_passes

    x = torch.randn(2, 3, 8, 8)
    calls: list[str] = []
    gm = torch.fx.symbolic_trace(IdentityThenConv().eval())
    measurer = Measurer(clock=clock_of({"baseline": 1.0, "candidate": 0.5}, calls))
    record = run_passes(
        gm,
        resolve_pipeline(["remove_identity", "mkldnn_fusion"]),
        example_inputs=(x,),
        training=False,
        measure=measurer,
        captured_s=1.0,
    )
    assert [p.name for p in record.passes if p.modified] == ["remove_identity", "mkldnn_fusion"]
    assert calls == ["candidate"]  # "without" is the original's run: the identity costs nothing

    calls.clear()
    gm = torch.fx.symbolic_trace(nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8)).eval())
    record = run_passes(
        gm,
        resolve_pipeline(["fold_conv_bn", "mkldnn_fusion"]),
        example_inputs=(x,),
        training=False,
        measure=Measurer(clock=clock_of({"baseline": 1.0, "candidate": 0.5}, calls)),
        captured_s=1.0,
    )
    assert [p.name for p in record.passes if p.modified] == ["fold_conv_bn", "mkldnn_fusion"]
    # The fold changed what the graph computes: mkldnn_fusion times its own "without".
    assert calls == ["baseline", "candidate"]


def test_verification_of_a_kept_rewrite_takes_its_timed_run_instead_of_running_again() -> None:
    from distopt.config import VerifyConfig
    from distopt.optimize.verify import compare_modules, run_reference

    model = ConvRelu().eval()
    x = torch.randn(2, 3, 8, 8)
    reference = run_reference(model, (x,), VerifyConfig())
    gm = torch.fx.symbolic_trace(model)
    ctx = PassContext(example_inputs=(x,), training=False, measure=_calling(1.0, 0.5))
    assert mkldnn_fusion(gm, ctx).modified
    gm.recompile()
    count = [0]
    graph_forward = gm.forward

    def forward(*args: Any) -> Any:
        count[0] += 1
        return graph_forward(*args)

    gm.forward = forward  # type: ignore[method-assign]
    record = compare_modules(model, gm, (x,), VerifyConfig(), reference=reference)
    assert record.passed and count == [0]
    # A second check has no timed run to take: it runs the graph.
    assert compare_modules(model, gm, (x,), VerifyConfig(), reference=reference).passed
    assert count == [1]


def test_putting_the_models_state_aside_and_back_is_not_timed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The measurement's own work around each timed call (on an H200, ResNet-50's 159 BatchNorm
    buffers made its timed calls 4–6× the model's) is left out: a state that takes 0.1 s to put
    aside and 0.1 s to put back leaves a call of well under a millisecond under 50 ms."""
    slow_calls: list[int] = []

    @contextlib.contextmanager
    def slow_preserved_state(*modules: nn.Module) -> Iterator[list[torch.Tensor]]:
        slow_calls.append(len(modules))
        time.sleep(0.1)
        with preserved_state(*modules) as restored:
            yield restored
        time.sleep(0.1)

    monkeypatch.setattr(measured, "preserved_state", slow_preserved_state)
    gm = torch.fx.symbolic_trace(ConvRelu().eval())
    measurer = Measurer(clock=ab.wall_clock, min_rounds=1, min_time_s=0.0, max_rounds=2)
    result = channels_last(gm, _eval_ctx(measurer))
    timings = re.search(r"with ([\d.]+) ms vs without ([\d.]+) ms", result.detail)
    assert timings is not None, result.detail  # a second or more reads "1.2 s"
    assert slow_calls, "the measured pass did not put the state aside"
    assert float(timings[1]) < 50 and float(timings[2]) < 50, result.detail
