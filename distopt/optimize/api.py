"""``distopt.optimize``: capture, run the pass pipeline, verify, and report."""

from __future__ import annotations

import dataclasses
import inspect
import time
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch
import torch.fx
from torch import nn

from distopt.capture import Tier, describe_failure, dynamo_capture, symbolic_capture
from distopt.config import OptimizeConfig, VerifyConfig, from_dict, key_text
from distopt.errors import (
    CaptureError,
    ConfigError,
    DistoptFallbackWarning,
    DistoptUnverifiedWarning,
    PassError,
    RemoteCallError,
    VerificationError,
)
from distopt.estimate.ab import (
    LONG_CALL_S,
    ABResult,
    Measurer,
    entered_untimed,
    format_seconds,
    measurer_for_this_process,
)
from distopt.optimize.backend import make_backend
from distopt.optimize.explain import draw_graph
from distopt.optimize.verify import Reference, compare_modules, run_reference
from distopt.passes import PassSpec, resolve_pipeline, run_passes
from distopt.remote.intercept import makes_remote_calls
from distopt.remote.isolation import forked_rng, preserved_state
from distopt.remote.local import with_remote_calls
from distopt.remote.ops import remote_ops, remote_write_of
from distopt.remote.record import RemoteWrite, RemoteWriteRefused
from distopt.report import GraphRecord, OptimizeReport, VerifyRecord, attach


class _SymbolicOff(Exception):
    """``capture.symbolic`` is off: go straight to Dynamo."""


def _normalize_config(config: OptimizeConfig | Mapping[str, Any] | None) -> OptimizeConfig:
    if config is None:
        return OptimizeConfig()
    if isinstance(config, OptimizeConfig):
        return config
    if isinstance(config, Mapping):
        return from_dict(OptimizeConfig, config, prefix="config")
    raise ConfigError(f"config: expected OptimizeConfig or a mapping, got {type(config).__name__}")


def _normalize_inputs(model: nn.Module, example_inputs: Any) -> tuple[Any, ...] | None:
    if example_inputs is None:
        return None
    if isinstance(example_inputs, torch.Tensor):
        inputs: tuple[Any, ...] = (example_inputs,)
    elif isinstance(example_inputs, (tuple, list)):
        inputs = tuple(example_inputs)
    else:
        raise ConfigError(
            f"example_inputs: expected a tensor or a tuple of positional inputs, "
            f"got {type(example_inputs).__name__}"
        )
    try:
        inspect.signature(model.forward).bind(*inputs)
    except TypeError as err:
        params = inspect.signature(model.forward).parameters
        arity = len(
            [p for p in params.values() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        )
        raise ConfigError(
            f"example_inputs: {type(model).__name__}.forward takes {arity} positional input(s), "
            f"got {len(inputs)} ({err})"
        ) from None
    except ValueError:  # builtins without a signature: let the forward call decide
        pass
    return inputs


def check_pass_options(
    pipeline: Sequence[PassSpec], options: Mapping[str, Mapping[str, Any]]
) -> None:
    """Every ``pass_options`` entry names a pass of the pipeline and options that pass declares."""
    by_name = {spec.name: spec for spec in pipeline}
    for name, values in options.items():
        spec = by_name.get(name)
        if spec is None:
            raise ConfigError(
                f"pass_options.{key_text(name)}: {name!r} is not a pass in this pipeline"
            )
        unknown = sorted(set(values) - set(spec.options))
        if unknown:
            known = (
                f"known options: {', '.join(spec.options)}"
                if spec.options
                else "it takes no options"
            )
            raise ConfigError(
                f"pass_options.{key_text(name)}.{key_text(unknown[0])}: unknown option ({known})"
            )


def optimize(
    model: nn.Module,
    example_inputs: Any = None,
    *,
    passes: Iterable[str | PassSpec] | None = None,
    config: OptimizeConfig | Mapping[str, Any] | None = None,
    verify: bool | None = None,
    strict: bool = False,
) -> nn.Module:
    """Capture ``model`` into torch.fx IR, run graph passes, and check the result.

    Args:
        model: the training model. It is never modified; the result shares its parameters.
        example_inputs: positional inputs for one forward call (a tensor or a tuple). Needed
            for verification and for passes that profile the graph.
        passes: pass names to run (default: the registry's default passes, in constraint order).
        config: :class:`~distopt.config.OptimizeConfig` or a mapping with the same keys.
        verify: compare outputs and gradients with the original (default: when inputs are given).
        strict: raise instead of falling back to the original model.

    Returns:
        A module with the same ``state_dict`` keys as ``model``: a ``GraphModule`` (symbolic
        tier), a Dynamo-compiled shallow copy (dynamo tier) or ``model`` itself (fallback).
        ``distopt.explain(result)`` prints what happened.
    """
    if not isinstance(model, nn.Module):
        raise ConfigError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
    cfg = _normalize_config(config)
    if passes is not None:
        if isinstance(passes, str):
            raise ConfigError(f"passes: expected a list of pass names, got the string {passes!r}")
        passes = list(passes)
        if cfg.passes is not None:
            raise ConfigError(
                f"passes: given twice, as passes={passes!r} and as config passes={list(cfg.passes)!r} "
                "(give one)"
            )
    elif cfg.passes is not None:
        passes = list(cfg.passes)
    pipeline = resolve_pipeline(passes)
    check_pass_options(pipeline, cfg.pass_options)
    inputs = _normalize_inputs(model, example_inputs)
    if verify is None:
        verify = inputs is not None
    elif verify and inputs is None:
        raise ConfigError("verify=True needs example_inputs to run both models")

    start = time.perf_counter()
    report = OptimizeReport(model=type(model).__qualname__, tier=Tier.EAGER.value)
    report.pass_names = [spec.name for spec in pipeline]
    optimized, reference = _capture_and_transform(
        model, inputs, pipeline, cfg, strict, report, reference_first=verify
    )
    if optimized is not model and verify:
        assert inputs is not None
        optimized = _verify_or_fall_back(
            model, optimized, inputs, pipeline, cfg, strict, report, reference=reference
        )
    if optimized is not model and inputs is not None and not model.training and cfg.measure.enabled:
        optimized = _keep_if_not_slower(model, optimized, inputs, cfg, report, warm=verify)
    if optimized is not model and cfg.dump_graph and isinstance(optimized, torch.fx.GraphModule):
        report.warnings.extend(draw_graph(optimized, cfg.dump_graph))
    report.total_seconds = time.perf_counter() - start
    attach(optimized, report)
    return optimized


def _capture_and_transform(
    model: nn.Module,
    inputs: tuple[Any, ...] | None,
    pipeline: Sequence[PassSpec],
    cfg: OptimizeConfig,
    strict: bool,
    report: OptimizeReport,
    *,
    reference_first: bool = False,
) -> tuple[nn.Module, Reference | None]:
    """The captured and transformed model (or ``model`` itself, fallen back), and, with
    ``reference_first``, the original's verification run when it was made before the passes
    (:func:`_reference_before_passes`)."""
    start = time.perf_counter()
    try:
        if not cfg.capture.symbolic:
            raise _SymbolicOff()
        gm = symbolic_capture(model, cfg.capture, inputs)
    except ConfigError:
        raise
    except _SymbolicOff:
        report.reason = "symbolic tracing off (config capture.symbolic=false)"
    except Exception as err:  # any tracing failure moves on to the next tier
        report.reason = f"symbolic tracing failed: {describe_failure(err)}"
    else:
        report.capture_seconds = time.perf_counter() - start
        report.tier = Tier.SYMBOLIC.value
        report.guards = list(gm.meta["distopt_guards"])
        report.graphs.append(GraphRecord(code_before=gm.code))
        reference = _reference_before_passes(model, gm, inputs, cfg) if reference_first else None
        try:
            run_passes(
                gm,
                pipeline,
                example_inputs=inputs,
                pass_options=cfg.pass_options,
                training=model.training,
                record=report.graphs[0],
                measure=_measurer(cfg),
                captured_s=None if reference is None else reference.seconds,
            )
        except PassError as err:
            if strict:
                raise
            return _fall_back(model, report, _blame(model, inputs, cfg, err)), None
        return gm, reference

    if not cfg.capture.dynamo:
        if strict:
            raise CaptureError(f"{report.model}: {report.reason}; Dynamo capture is disabled")
        return _fall_back(model, report, report.reason or "capture failed"), None
    backend = make_backend(
        pipeline,
        pass_options=cfg.pass_options,
        report=report,
        strict=strict,
        training=model.training,
        measure=_measurer(cfg),
    )
    report.tier = Tier.DYNAMO.value
    report.capture_seconds = time.perf_counter() - start
    try:
        compiled = dynamo_capture(model, backend)
    except Exception as err:
        if strict:
            raise CaptureError(
                f"{report.model}: Dynamo capture failed: {describe_failure(err)}"
            ) from err
        return _fall_back(
            model, report, f"{report.reason}; Dynamo capture failed: {describe_failure(err)}"
        ), None
    # Dynamo captures lazily; without inputs the graphs appear on the first call.
    if inputs is None:
        report.warnings.append("Dynamo graphs are captured on the first call (no example_inputs)")
    return compiled, None


def _reference_before_passes(
    model: nn.Module,
    gm: torch.fx.GraphModule,
    inputs: tuple[Any, ...] | None,
    cfg: OptimizeConfig,
) -> Reference | None:
    """The original's verification run, made before the passes of a traced eval graph that
    makes no remote call, so that measured passes take it as the captured graph's first sample
    instead of calling that graph again (as Dynamo's backend does with the run it follows).
    None elsewhere, and when the original fails: verification then runs it as usual and
    reports why."""
    if inputs is None or model.training or not cfg.measure.enabled or remote_ops(gm.graph):
        return None
    try:
        reference = run_reference(model, inputs, cfg.verify, allow_writes=False)
    except Exception:
        return None
    if reference.recording.calls:  # a leaf module called a server: verification replays it
        return None
    return reference


def _blame(
    model: nn.Module, inputs: tuple[Any, ...] | None, cfg: OptimizeConfig, err: PassError
) -> str:
    """Why a pass failed: the pass, or the example inputs when the model as written fails on
    them too (a wrong shape is the user's to fix, not a pass's bug). The original runs forward
    only, its remote writes refused unsent."""
    if inputs is None:
        return str(err)
    try:
        run_reference(
            model, inputs, dataclasses.replace(cfg.verify, check_grads=False), allow_writes=False
        )
    except RemoteWriteRefused:
        return str(err)  # it runs far enough to write: the inputs are not what failed
    except Exception as original:
        return (
            f"{_original_failed(original)} (so did pass {err.pass_name!r} on the same example "
            "inputs)"
        )
    return str(err)


def _original_failed(err: BaseException) -> str:
    """The fallback reason when the model as written fails on the example inputs."""
    return f"running the original model failed: {describe_failure(err)}"


def _measurer(cfg: OptimizeConfig) -> Measurer | None:
    m = cfg.measure
    return (
        measurer_for_this_process(margin=m.margin, budget_s=m.budget_s, max_rounds=m.max_rounds)
        if m.enabled
        else None
    )


def _fall_back(model: nn.Module, report: OptimizeReport, reason: str) -> nn.Module:
    report.tier = Tier.EAGER.value
    report.fallback = reason
    warnings.warn(
        f"distopt: returning {report.model} unoptimized: {reason}",
        DistoptFallbackWarning,
        stacklevel=4,  # the user's call of distopt.optimize
    )
    return model


def _verify_or_fall_back(
    model: nn.Module,
    optimized: nn.Module,
    inputs: tuple[Any, ...],
    pipeline: Sequence[PassSpec],
    cfg: OptimizeConfig,
    strict: bool,
    report: OptimizeReport,
    *,
    reference: Reference | None = None,
) -> nn.Module:
    """Verify ``optimized`` against ``model`` (its run ``reference``, when it was made already),
    or fall back."""
    if reference is not None:
        return _verified(model, optimized, inputs, pipeline, cfg, strict, report, reference)
    # Checking would apply the model's remote writes once (the original's run): not without the
    # user's say-so. Writes in a traced graph are known up front; under Dynamo, and in backward,
    # the original's run stops at the first one, before sending it.
    writes = _remote_writes(optimized)
    if writes and not cfg.verify.remote_writes:
        _warn_undeclared(report.model, writes[0], "is returned unverified: it sends")
        return _skip_verification(optimized, cfg, report, writes)
    verify_cfg = cfg.verify
    unsent: RemoteWrite | None = None
    try:
        reference = run_reference(model, inputs, verify_cfg, allow_writes=cfg.verify.remote_writes)
    except RemoteWriteRefused as err:
        if not err.in_backward:
            _warn_undeclared(report.model, err.write, "is returned unverified: it sends")
            return _skip_verification(optimized, cfg, report, [err.write])
        # Only backward writes (a push of the rows' gradients): the outputs can still be
        # compared, with no backward and so nothing sent.
        _warn_undeclared(
            report.model,
            err.write,
            "has its outputs verified but not its gradients: backward sends",
        )
        unsent = err.write
        report.backward_writes = [err.write.describe()]
        verify_cfg = dataclasses.replace(cfg.verify, check_grads=False)
        reference = run_reference(model, inputs, verify_cfg, allow_writes=False)
    except (ConfigError, RemoteCallError):
        raise  # distopt's own one-line diagnosis (an unknown table, a server unreachable)
    except Exception as err:  # the user's own model failed on the example inputs
        if strict:
            raise
        # No reference to check against; e.g. a model whose remote calls have no RPC group.
        return _fall_back(model, report, _original_failed(err))
    else:
        report.backward_writes = [w.describe() for w in reference.recording.backward_writes]
    return _verified(
        model,
        optimized,
        inputs,
        pipeline,
        cfg,
        strict,
        report,
        reference,
        verify_cfg=verify_cfg,
        unsent=unsent,
    )


def _verified(
    model: nn.Module,
    optimized: nn.Module,
    inputs: tuple[Any, ...],
    pipeline: Sequence[PassSpec],
    cfg: OptimizeConfig,
    strict: bool,
    report: OptimizeReport,
    reference: Reference,
    *,
    verify_cfg: VerifyConfig | None = None,
    unsent: RemoteWrite | None = None,
) -> nn.Module:
    """``optimized`` if it computes as ``model`` did in ``reference`` (checked with
    ``verify_cfg``, ``cfg.verify`` by default), else ``model``, fallen back."""
    verify_cfg = verify_cfg or cfg.verify
    if not reference.check_grads:  # an inference run: the final timing check's first sample
        report.original_seconds = reference.seconds
    dropped = _assignments_dropped(optimized, reference.rebound)
    if dropped:
        message = (
            f"{report.model}.forward assigns {', '.join(dropped)} (Python attributes): a traced "
            "graph repeats only its tensor operations, so the optimized model would not; "
            "config capture.symbolic=false captures it with Dynamo, which repeats them"
        )
        if strict:
            raise VerificationError(message)
        return _fall_back(model, report, message)
    try:
        record = compare_modules(
            model,
            optimized,
            inputs,
            verify_cfg,
            reference=reference,
            reordered=lambda: report.reorders_float,
        )
    except Exception as err:
        if strict:
            raise
        # Dynamo captures (and runs our passes) during this first call.
        return _fall_back(
            model, report, f"running the optimized model failed: {describe_failure(err)}"
        )
    if unsent is not None:
        record.partial = (
            f"gradients not compared: backward sends {unsent.describe()}; " + _declare_hint(unsent)
        )
    report.verification = record
    if record.passed:
        return optimized
    culprit = None
    if cfg.verify.bisect and pipeline:
        culprit = _bisect_culprit(
            model, inputs, pipeline, dataclasses.replace(cfg, verify=verify_cfg), reference
        )
        record.culprit = culprit
    where = f"pass {culprit!r} broke equivalence" if culprit else "outputs differ"
    message = f"verification failed for {report.model}: {where}: {record.message}"
    if strict:
        raise VerificationError(message, culprit=culprit)
    return _fall_back(model, report, message)


def _assignments_dropped(optimized: nn.Module, rebound: Sequence[str]) -> list[str]:
    """The attributes the original's forward assigned that ``optimized`` would not: all of them
    for a traced graph, but those of the modules it calls (leaves, whose own forward runs)."""
    if not isinstance(optimized, torch.fx.GraphModule):
        return []  # Dynamo's graphs repeat a forward's attribute assignments
    leaves = [str(n.target) for n in optimized.graph.nodes if n.op == "call_module"]
    return [name for name in rebound if not any(name.startswith(f"{leaf}.") for leaf in leaves)]


def _keep_if_not_slower(
    model: nn.Module,
    optimized: nn.Module,
    inputs: tuple[Any, ...],
    cfg: OptimizeConfig,
    report: OptimizeReport,
    *,
    warm: bool,
) -> nn.Module:
    """An eval model is returned optimized only if it is not slower than the original.

    Passes measure their own rewrites; this catches what no pass owns (Dynamo's guards and graph
    breaks on a small model, a GraphModule's call overhead). After verification (``warm``) both
    models have just run, so no warm-up; a model that makes remote calls is not timed (they would
    repeat).
    """
    if isinstance(optimized, torch.fx.GraphModule) and remote_ops(optimized.graph):
        return optimized
    if not isinstance(optimized, torch.fx.GraphModule) and makes_remote_calls(
        with_remote_calls(model)
    ):
        return optimized
    measurer = _measurer(cfg)
    assert measurer is not None  # cfg.measure.enabled

    def timed(module: nn.Module) -> Callable[[], object]:
        def call() -> object:
            with entered_untimed(preserved_state(module), torch.no_grad(), forked_rng()):
                return module(*inputs)

        return call

    # The original has run for verification (its time is the first round's baseline sample when
    # that run was an inference run); the optimized model too, but under Dynamo that first call
    # also compiled it. A measured pass may have timed the optimized graph already: with one
    # graph and a long call, that is a sample of the whole model (what a model adds around its
    # graph — Dynamo's guards, a GraphModule's call — is microseconds, seen only on short calls).
    graph_s = report.graphs[0].measured_seconds if len(report.graphs) == 1 else None
    if warm and graph_s is not None and graph_s >= LONG_CALL_S and report.original_seconds:
        # Both sides are known, and what this check guards against is microseconds against such
        # a call, so it decides on those two samples: the optimized model is returned unless it
        # was clearly slower. Rounds of calls of a second or more cannot tell apart what the
        # passes' interleaved A/B already did (a 1.6 vs 1.5 s round, 10% apart on a shared host,
        # had returned ConvNeXt-T's original after its fusion measured faster, and cost 3 s).
        # The original's sample is its first call, a few percent slow: the band holds that too.
        result = ABResult(report.original_seconds, graph_s, rounds=1)
        kept = not measurer.clearly_slower(result)
        timing = (
            f"optimized {format_seconds(graph_s)} (its passes' median) vs original "
            f"{format_seconds(report.original_seconds)} (its verification run)"
        )
    else:
        result = measurer.compare(
            timed(model),
            timed(optimized),
            warm=warm,
            baseline_s=report.original_seconds if warm else None,
        )
        kept = measurer.not_slower(result)
        timing = result.describe("optimized", "original")
    if kept:
        report.speed = f"{timing}: optimized model kept"
        return optimized
    report.speed = f"{timing}: the original returned"
    report.tier = Tier.EAGER.value
    report.fallback = f"the optimized model measured slower than the original: {timing}"
    return model


_WARNED: set[str] = set()
"""Server functions a :class:`DistoptUnverifiedWarning` named already (once per process)."""


def _warn_undeclared(model: str, write: RemoteWrite, what: str) -> None:
    """Once per server function: the model is not (fully) verified only because ``write``'s
    function is declared neither a read nor a write, and the user can say which."""
    fn = write.undeclared
    if fn is None:
        return  # a declared write: the report says why verification did not run
    key = f"{getattr(fn, '__module__', '')}.{getattr(fn, '__qualname__', repr(fn))}"
    if key in _WARNED:
        return
    _WARNED.add(key)
    warnings.warn(
        f"distopt: {model} {what} {write.describe()}; {_declare_hint(write)}",
        DistoptUnverifiedWarning,
        stacklevel=4,  # the user's call of distopt.optimize
    )


def _declare_hint(write: RemoteWrite) -> str:
    """How the user makes a write verifiable: declare what its server function does."""
    if write.undeclared is None:
        return "config verify.remote_writes=true lets verification apply it once"
    name = getattr(write.undeclared, "__name__", None) or repr(write.undeclared)
    return (
        f"{name} is declared neither a read nor a write, so distopt counts it a write and never "
        f"sends it twice: decorate it with @distopt.register_read if it only reads server state "
        f"(then it is verified), or @distopt.register_write if it writes (config "
        f"verify.remote_writes=true then lets verification apply it once)"
    )


def _skip_verification(
    optimized: nn.Module, cfg: OptimizeConfig, report: OptimizeReport, writes: Sequence[RemoteWrite]
) -> nn.Module:
    more = f" and {len(writes) - 1} more" if len(writes) > 1 else ""
    reason = f"the model writes to remote state ({writes[0].describe()}{more}); {_declare_hint(writes[0])}"
    report.verification = VerifyRecord(
        passed=True,
        max_abs_diff=0.0,
        rtol=cfg.verify.rtol,
        atol=cfg.verify.atol,
        compared=0,
        skipped=reason,
    )
    return optimized


def _remote_writes(module: nn.Module) -> list[RemoteWrite]:
    """The remote writes in ``module``'s graph, in graph order (none known outside a graph)."""
    if not isinstance(module, torch.fx.GraphModule):
        return []
    ops = remote_ops(module.graph)
    return [remote_write_of(op) for n, op in ops.items() if n is op.start and op.is_write]


def _bisect_culprit(
    model: nn.Module,
    inputs: tuple[Any, ...],
    pipeline: Sequence[PassSpec],
    cfg: OptimizeConfig,
    reference: Reference,
) -> str | None:
    """Find the first pass whose prefix of the pipeline makes outputs differ (O(log n) runs of
    candidates against the one reference run of the original)."""

    def prefix_ok(k: int) -> bool:
        quiet = dataclasses.replace(cfg, passes=None, dump_graph=None)
        scratch = OptimizeReport(model=type(model).__qualname__, tier="")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DistoptFallbackWarning)
            candidate, _ = _capture_and_transform(model, inputs, pipeline[:k], quiet, True, scratch)
        return compare_modules(
            model,
            candidate,
            inputs,
            cfg.verify,
            reference=reference,
            reordered=lambda: scratch.reorders_float,
        ).passed

    lo, hi = 0, len(pipeline)  # prefix lo is fine (assumed for lo=0), prefix hi is broken
    try:
        if not prefix_ok(0):
            return None  # capture alone changes results: no single pass to blame
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if prefix_ok(mid):
                lo = mid
            else:
                hi = mid
    except Exception:
        return None
    return pipeline[hi - 1].name
