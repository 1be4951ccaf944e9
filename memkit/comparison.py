"""`compare()`: run a baseline and variants on the same weights and inputs, tracked, side by side.

A variant is a list of optimizations (the short form) or a :class:`Variant`: its optimizations, its own
:class:`~memkit.Step` if it differs from the comparison's, and its own correctness check (an EMA variant
checks its shadows against a reference). Every variant's step is the same object everyone runs
(`memkit.Step`), and the memory its optimizations own (their handle's ``owned()``) is counted in its category.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import pandas as pd
import torch
from tqdm.auto import tqdm

from .handle import Handle, Optimization, apply_all
from .memory.events import CATEGORIES
from .memory.recording import track
from .memory.timeline import Timeline
from .models import load_model, make_inputs
from .presets import PRESETS
from .step import Step
from .units import unit_scale

Check = Callable[[torch.nn.Module, Handle], Mapping[str, float]]


@dataclass(frozen=True, kw_only=True)
class Variant:
    """One variant of a comparison: optimizations, and optionally its own step and correctness check.

    A plain list of optimizations is the short form of ``Variant(optimizations=...)``.

    Example:
        >>> ckpt = memkit.Variant(optimizations=[memkit.Checkpointing()])
        >>> memkit.compare("flux", {"ckpt": ckpt, "same": []})
    """

    optimizations: Sequence[Optimization] = ()
    """Applied in order with ``apply_all`` (removed in reverse order after the variant ran)."""
    step: Step | None = None
    """The step this variant runs; None: the comparison's step."""
    check: Check | None = None
    """``check(model, handle) -> {name: difference}`` after the compared step (the first one): extra
    correctness measures, each a difference that must be at most the comparison's ``tolerance`` (the check
    scales it). Each name becomes a table column."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "optimizations", tuple(self.optimizations))
        if self.step is not None and not isinstance(self.step, Step):
            raise TypeError(f"step must be a memkit.Step or None, got {type(self.step).__name__}")
        if self.check is not None and not callable(self.check):
            raise TypeError(f"check must be callable or None, got {type(self.check).__name__}")


@dataclass
class VariantResult:
    """One row of a comparison: the variant's timeline, time and differences against the baseline.

    Example:
        >>> r = memkit.compare("dit", {"ckpt": [memkit.Checkpointing()]}).results["ckpt"]
        >>> r.passed, r.max_abs_d_grad, r.timeline.peak_bytes
    """

    name: str
    """Variant name (``"baseline"`` for the reference)."""
    optimizations: list = field(default_factory=list)
    """The optimization objects applied."""
    timeline: Timeline | None = None
    """The tracked timeline of the measured step."""
    seconds: float = float("nan")
    """Wall time of the step, untracked (median of the timed repeats)."""
    max_abs_d_output: float = 0.0
    """max |output - baseline output|."""
    max_abs_d_grad: float = 0.0
    """max over parameters of max |grad - baseline grad| (training only; 0.0 in inference)."""
    max_abs_d_param: float = 0.0
    """max over parameters of max |param - baseline param| after the first update (only with an optimizer)."""
    checks: dict[str, float] = field(default_factory=dict)
    """The variant's own check: name -> difference (see :class:`Variant`)."""
    step: Step | None = None
    """The step the variant ran."""
    passed: bool = True
    """Every difference (output, gradients, parameters, the variant's checks) within the tolerance."""
    measured: bool = True
    """False for timelines put side by side with :meth:`Comparison.from_timelines` (no time, no differences)."""


@dataclass
class Comparison:
    """Baseline and variants, run on the same weights and inputs. Build it with :func:`compare`.

    Example:
        >>> cmp = memkit.compare("flux", {"checkpointing": [memkit.Checkpointing()]})
        >>> cmp.table()                   # one row per variant
        >>> cmp.results["checkpointing"].timeline.peak_bytes
    """

    results: dict[str, VariantResult]
    """Results in display order, the baseline first."""
    mode: str
    """``"training"`` (forward + loss + backward) or ``"inference"`` (forward under ``no_grad``)."""
    tolerance: float
    """A variant passes when max |Δ| ≤ tolerance × max(1, max |baseline|), for the output and every grad."""
    baseline: str = "baseline"

    @classmethod
    def from_timelines(
        cls, timelines: Mapping[str, Timeline], *, mode: str = "training", baseline: str | None = None
    ) -> Comparison:
        """Put timelines that were not made by :func:`compare` (estimates, snapshots) side by side: same table
        and figure, without time or output columns (nothing was run to compare outputs).

        Example:
            >>> tls = {"plain": memkit.estimate("flux"), "ckpt": memkit.estimate("flux", optimizations=[ckpt])}
            >>> memkit.Comparison.from_timelines(tls).figure(unit="GiB").show()
        """
        if not timelines:
            raise ValueError("timelines must map at least one name to a Timeline")
        for name, tl in timelines.items():
            if not isinstance(tl, Timeline):
                raise TypeError(f"timelines[{name!r}] must be a Timeline, got {type(tl).__name__}")
        names = list(timelines)
        baseline = names[0] if baseline is None else baseline
        if baseline not in timelines:
            raise ValueError(f"baseline must be one of {names}, got {baseline!r}")
        order = [baseline] + [n for n in names if n != baseline]
        results = {n: VariantResult(n, timeline=timelines[n], measured=False) for n in order}
        return cls(results=results, mode=mode, tolerance=float("nan"), baseline=baseline)

    def table(self, unit: str = "MiB") -> pd.DataFrame:
        """One row per variant: peak total and by category (in ``unit``), step time, differences, pass. For
        estimates of the first and the steady step (:func:`memkit.estimate`'s default), each step's peak too: the
        peak is the larger.

        Example:
            >>> memkit.compare("flux", {"ckpt": [memkit.Checkpointing()]}).table()
        """
        scale = unit_scale(unit)
        base = self.results[self.baseline]
        peaks = {name: r.timeline.peak_by_category() for name, r in self.results.items()}
        shown = [cat for cat in CATEGORIES if any(p[cat] for p in peaks.values())]
        check_names = list(dict.fromkeys(c for r in self.results.values() for c in r.checks))
        # estimates of the first and the steady step: each step's peak beside the larger one
        both = any(r.timeline.meta.get("measured") == "first and steady" for r in self.results.values())
        rows = []
        for name, r in self.results.items():
            tl = r.timeline
            row = {
                "variant": name,
                "optimizations": ", ".join(str(o) for o in r.optimizations) or "-",
                f"peak ({unit})": tl.peak_bytes / scale,
                "peak vs baseline": tl.peak_bytes / base.timeline.peak_bytes,
            }
            if both:
                for key, label in (("first_step_peak_bytes", "first step"), ("steady_peak_bytes", "steady step")):
                    value = tl.meta.get(key)
                    row[f"{label} ({unit})"] = value / scale if value is not None else float("nan")
            for cat in shown:
                row[f"{cat} ({unit})"] = peaks[name][cat] / scale
            row["peak phase"] = tl.peak_phase
            if r.measured:
                row["step (s)"] = r.seconds
                row["time vs baseline"] = r.seconds / base.seconds if base.seconds > 0 else float("nan")
                row["max |Δoutput|"] = r.max_abs_d_output
                if self.mode == "training":
                    row["max |Δgrad|"] = r.max_abs_d_grad
                if any(x.step is not None and x.step.optimizer for x in self.results.values()):
                    row["max |Δparam|"] = r.max_abs_d_param
                for check in check_names:
                    row[check] = r.checks.get(check, float("nan"))
                row["pass"] = r.passed
            rows.append(row)
        return pd.DataFrame(rows).set_index("variant")

    def figure(self, unit: str = "MiB"):
        """Peak by category per variant, and the memory curves side by side (a plotly figure)."""
        from .plots import comparison_figure

        return comparison_figure(self, unit=unit)

    def _repr_html_(self) -> str:
        return self.table()._repr_html_()

    def __repr__(self) -> str:
        return f"Comparison(mode={self.mode!r}, variants={list(self.results)})"


def _model_factory(model: str | Callable[[], torch.nn.Module], seed: int) -> Callable[[], torch.nn.Module]:
    if isinstance(model, str):
        from .naming import resolve

        ref = resolve(model)  # a preset by name or hub id; ValueError for an unknown name
        if ref.preset is None:
            raise ValueError(
                f"model_fn={model!r} is a config ({ref.class_name}): compare runs real tensors, and a config has one "
                "size, its own (a released model's is tens of GB). Pass a preset, which compare builds tiny, or a "
                "callable that builds the model at the size you want"
            )
        return lambda: load_model(ref.preset, size="tiny", seed=seed)
    if callable(model):
        return model
    raise TypeError(f"model_fn must be a preset name ({sorted(PRESETS)}) or a callable returning a model")


def _variant_of(name: str, value: Variant | Sequence[Optimization]) -> Variant:
    if isinstance(value, Variant):
        return value
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise TypeError(
            f"variants[{name!r}] must be a memkit.Variant or a list of optimizations, got {type(value).__name__}"
        )
    return Variant(optimizations=value)


def _refuse_estimate_only(runs: Mapping[str, Variant]) -> None:
    """An optimization the registry says only estimates take (``memkit.FSDP``) is a ValueError saying why."""
    from .optimizations import spec_of

    for name, variant in runs.items():
        for o in variant.optimizations:
            spec = spec_of(o)
            if spec is not None and spec.estimate_only:
                raise ValueError(
                    f"variants[{name!r}]: {o} is estimate-only, compare does not take it: {spec.estimate_only}. "
                    "Use memkit.estimate(..., optimizations=[...]) for its memory"
                )


def _base_name(name: str) -> str:
    """A parameter's name in the unadapted model: peft keeps a wrapped layer's own under ``.base_layer``."""
    return name.replace(".base_layer.", ".")


def _clone_grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {_base_name(n): p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _clone_params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    from .optimizations.offload import onloaded

    with onloaded(model):  # an offloaded model's real weights, not its placeholders
        return {_base_name(n): p.detach().clone() for n, p in model.named_parameters()}


def _max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max()) if a.numel() else 0.0


def _scale_of(t: torch.Tensor) -> float:
    return max(1.0, float(t.float().abs().max())) if t.numel() else 1.0


def _within(d: float, ref: torch.Tensor, tolerance: float) -> bool:
    return d <= tolerance * _scale_of(ref)


@dataclass
class _Reference:
    """What the compared (first) step of a run produced: output, gradients, parameters after the update."""

    output: torch.Tensor
    grads: dict[str, torch.Tensor]
    params: dict[str, torch.Tensor] | None
    frozen: frozenset[str] = frozenset()
    """Parameters that do not require grad in this run (the base model under LoRA)."""


def _reference_step(runner, inputs: Mapping[str, Any], seed: int) -> _Reference:
    captured: dict[str, Any] = {}
    # Same random stream for every variant: dropout and label dropping (DiT) draw the same numbers.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        runner.run(
            inputs,
            on_output=lambda out: captured.__setitem__("output", out.detach().clone()),
            on_grads=lambda model: captured.__setitem__("grads", _clone_grads(model)),
        )
    params = _clone_params(runner.model) if runner.step.training else None
    frozen = frozenset(_base_name(n) for n, p in runner.model.named_parameters() if not p.requires_grad)
    return _Reference(captured["output"], captured.get("grads", {}), params, frozen)


def _differences(
    result: VariantResult, got: _Reference, ref: _Reference, tolerance: float, initial: Mapping[str, torch.Tensor]
) -> bool:
    """Output, gradients and updated parameters against the baseline's. A variant that freezes parameters and
    trains its own (LoRA: the base frozen, adapters added) is held to that: its frozen parameters get no gradient
    and end the step as they began (``initial``); its own parameters, which the baseline lacks, have nothing to be
    compared with; every other gradient and parameter is compared as usual."""
    result.max_abs_d_output = _max_abs_diff(got.output, ref.output)
    ok = _within(result.max_abs_d_output, ref.output, tolerance)
    expected = {k for k in ref.grads if k not in got.frozen}  # what the baseline trained and the variant trains too
    own = set(got.grads) - set(ref.grads)
    if set(got.grads) - own != expected:
        raise RuntimeError(
            f"variant {result.name!r} produced gradients for different parameters than the baseline: "
            f"{sorted((set(got.grads) - own) ^ expected)[:5]}"
        )
    for k in expected:
        d = _max_abs_diff(got.grads[k], ref.grads[k])
        result.max_abs_d_grad = max(result.max_abs_d_grad, d)
        ok = _within(d, ref.grads[k], tolerance) and ok
    if got.params is not None and ref.params is not None:
        for k, p in got.params.items():
            want = initial.get(k) if k in got.frozen else ref.params.get(k)
            # the variant's own parameter (an adapter), or a frozen weight it stores quantized (memkit.Quantize:
            # packed codes, fp8 or a library's tensor subclass), whose stored values are not the weights to compare
            stored = (
                k in got.frozen
                and want is not None
                and (p.shape, p.dtype, type(p)) != (want.shape, want.dtype, type(want))
            )
            if want is None or stored:
                continue
            d = _max_abs_diff(p, want)
            result.max_abs_d_param = max(result.max_abs_d_param, d)
            ok = _within(d, want, tolerance) and ok
    return ok


def compare(
    model_fn: str | Callable[[], torch.nn.Module],
    variants: Mapping[str, Variant | Sequence[Optimization]],
    *,
    mode: str = "training",
    step: Step | None = None,
    inputs: Mapping[str, Any] | Callable[[torch.nn.Module], Mapping[str, Any]] | None = None,
    seed: int = 0,
    tolerance: float = 1e-4,
    repeats: int = 3,
    progress: bool = True,
) -> Comparison:
    """Run a baseline and each variant on the same weights and inputs, tracked, and compare them.

    Each variant gets a fresh model from ``model_fn`` loaded with the baseline's weights, its optimizations
    applied, and its step bound to it (a fresh optimizer). It then runs the compared step, recording the
    output, the gradients (after backward, before the update) and, with an optimizer, the parameters after
    the update (which is what tests an optimization's write-back), plus the variant's own check; then
    ``repeats`` untracked steps for the time (median); then one tracked step for the memory, which holds no
    extra reference to anything so the measured peak is the step's own. With an optimizer the tracked step
    is a steady one (its state exists). Costs ``(repeats + 2) × (variants + 1)`` steps; models are built one
    at a time.

    Args:
        model_fn: a preset name (its tiny size) or a callable returning a model.
        variants: name -> :class:`Variant`, or name -> list of optimizations (the short form), e.g.
            ``{"checkpointing": [memkit.Checkpointing()]}``. An estimate-only one (``memkit.FSDP``: rank 0 holds
            only its shard of the values) is a ValueError saying why; :func:`memkit.estimate` takes it.
        mode: ``"training"`` or ``"inference"``: the step, when ``step`` is not given.
        step: the :class:`memkit.Step` of the baseline and of every variant without its own. A variant's
            ``Step(fused_backward=True)`` is compared like any other: its gradients are recorded in the hooks,
            each before its update (a fused backward leaves none after it).
        inputs: forward kwargs, a callable ``inputs(model)`` (called once, with the first model), or None for
            ``memkit.make_inputs(model, seed=seed)``; every variant runs on the same tensors.
        seed: seeds the weights of a preset, the default inputs, and the random numbers of the compared step
            (the same for every variant, so dropout does not count as a difference).
        tolerance: relative tolerance of the pass/fail column (see :class:`Comparison`).
        repeats: timed steps per variant (0 skips timing).
        progress: show a progress bar.

    Example:
        >>> cmp = memkit.compare("flux", {"checkpointing": [memkit.Checkpointing()]})
        >>> cmp.table()
    """
    if step is None:
        step = Step(mode=mode)
    elif not isinstance(step, Step):
        raise TypeError(f"step must be a memkit.Step or None, got {type(step).__name__}")
    elif mode != "training" and mode != step.mode:
        raise ValueError(f"mode={mode!r} contradicts step.mode={step.mode!r}: give one of them")
    if not isinstance(variants, Mapping):
        raise TypeError("variants must map a name to a list of optimizations, e.g. {'ckpt': [Checkpointing()]}")
    runs = {str(k): _variant_of(str(k), v) for k, v in variants.items()}
    if "baseline" in runs:
        raise ValueError("variants must not be named 'baseline': that name is the unoptimized reference")
    _refuse_estimate_only(runs)
    if any((v.step or step).mode != step.mode for v in runs.values()):
        raise ValueError(f"every variant's step must be a {step.mode} step, like the comparison's")
    if not isinstance(tolerance, (int, float)) or not tolerance > 0:
        raise ValueError(f"tolerance must be > 0, got {tolerance!r}")
    if not isinstance(repeats, int) or repeats < 0:
        raise ValueError(f"repeats must be an int >= 0, got {repeats!r}")
    factory = _model_factory(model_fn, seed)
    runs = {"baseline": Variant(), **runs}
    results: dict[str, VariantResult] = {}
    state: dict[str, torch.Tensor] | None = None
    reference: _Reference | None = None
    step_inputs: Mapping[str, Any] | None = None
    bar = tqdm(runs.items(), desc="compare", disable=not progress, leave=False)
    for name, variant in bar:
        bar.set_postfix_str(name)
        model = factory()
        if state is None:
            state = {k: v.detach().clone() for k, v in model.state_dict().items()}
        else:
            model.load_state_dict(state)
        if step_inputs is None:  # built once, from the first model: every variant runs on the same tensors
            step_inputs = inputs(model) if callable(inputs) else inputs
            if step_inputs is None:
                step_inputs = make_inputs(model, seed=seed)
        variant_step = variant.step or step
        with apply_all(model, variant.optimizations) as handle:
            model.zero_grad(set_to_none=True)
            runner = variant_step.bind(model, handle)
            try:
                got = _reference_step(runner, step_inputs, seed)
                checks = {k: float(v) for k, v in variant.check(model, handle).items()} if variant.check else {}
                seconds = _time_steps(runner, step_inputs, repeats)
                model.zero_grad(set_to_none=True)
                with track(inputs=step_inputs, label=name, **runner.tracked_objects()) as tl:
                    runner.run(step_inputs)
            finally:  # a fused backward's hooks must not update the next variant's run of a shared model
                runner.remove()
            # after the compared and timed steps: the optimizer's state exists, the step is the steady one
            tl.meta["measured"] = "steady" if variant_step.training else "inference"
        result = VariantResult(name, list(variant.optimizations), tl, seconds, checks=checks, step=variant_step)
        ok = all(v <= tolerance for v in checks.values())
        if reference is None:
            reference = got
        else:
            ok = _differences(result, got, reference, tolerance, state) and ok
        result.passed = ok
        results[name] = result
        del model, runner, got
    return Comparison(results=results, mode=step.mode, tolerance=tolerance)


def _time_steps(runner, inputs: Mapping[str, Any], repeats: int) -> float:
    if repeats == 0:
        return float("nan")
    times = []
    for _ in range(repeats):
        if runner.optimizer is None:
            runner.model.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        runner.run(inputs)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)
