"""`compare()`: run a baseline and variants on the same weights and inputs, tracked, side by side."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import pandas as pd
import torch
from tqdm.auto import tqdm

from .handle import Optimization, apply_all
from .memory import CATEGORIES, Timeline, track
from .models import PRESETS, load_model, make_inputs, model_output, train_step
from .units import unit_scale


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
    passed: bool = True
    """Both differences within the comparison's tolerance."""
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
        """One row per variant: peak total and by category (in ``unit``), step time, differences, pass.

        Example:
            >>> memkit.compare("flux", {"ckpt": [memkit.Checkpointing()]}).table()
        """
        scale = unit_scale(unit)
        base = self.results[self.baseline]
        peaks = {name: r.timeline.peak_by_category() for name, r in self.results.items()}
        shown = [cat for cat in CATEGORIES if any(p[cat] for p in peaks.values())]
        rows = []
        for name, r in self.results.items():
            tl = r.timeline
            row = {
                "variant": name,
                "optimizations": ", ".join(str(o) for o in r.optimizations) or "-",
                f"peak ({unit})": tl.peak_bytes / scale,
                "peak vs baseline": tl.peak_bytes / base.timeline.peak_bytes,
            }
            for cat in shown:
                row[f"{cat} ({unit})"] = peaks[name][cat] / scale
            row["peak phase"] = tl.peak_phase
            if r.measured:
                row["step (s)"] = r.seconds
                row["time vs baseline"] = r.seconds / base.seconds if base.seconds > 0 else float("nan")
                row["max |Δoutput|"] = r.max_abs_d_output
                if self.mode == "training":
                    row["max |Δgrad|"] = r.max_abs_d_grad
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
        return lambda: load_model(model, "tiny", seed=seed)
    if callable(model):
        return model
    raise TypeError(f"model_fn must be a preset name ({sorted(PRESETS)}) or a callable returning a model")


def _step(model: torch.nn.Module, inputs: Mapping[str, Any], mode: str, capture: list | None = None) -> None:
    hook = None
    if capture is not None:
        hook = model.register_forward_hook(lambda m, a, out: capture.append(model_output(out).detach()))
    try:
        if mode == "training":
            train_step(model, inputs)
        else:
            with torch.no_grad():
                model(**inputs)
    finally:
        if hook is not None:
            hook.remove()


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max()) if a.numel() else 0.0


def _scale_of(t: torch.Tensor) -> float:
    return max(1.0, float(t.float().abs().max())) if t.numel() else 1.0


def compare(
    model_fn: str | Callable[[], torch.nn.Module],
    variants: Mapping[str, Sequence[Optimization]],
    mode: str = "training",
    inputs: Mapping[str, Any] | Callable[[torch.nn.Module], Mapping[str, Any]] | None = None,
    seed: int = 0,
    *,
    tolerance: float = 1e-4,
    repeats: int = 3,
    progress: bool = True,
) -> Comparison:
    """Run a baseline and each variant on the same weights and inputs, tracked, and compare them.

    Each variant gets a fresh model from ``model_fn`` loaded with the baseline's weights and its
    optimizations applied. It then runs one step that records the output and gradients (a backward from
    ``grad=None``; also the warm-up), ``repeats`` untracked steps for the time (median), and one tracked step
    for the memory, which holds no extra reference to anything so the measured peak is the step's own.
    Costs ``(repeats + 2) × (variants + 1)`` steps; models are built one at a time.

    Args:
        model_fn: a preset name (its tiny size) or a callable returning a model.
        variants: name → list of optimizations (e.g. ``{"checkpointing": [memkit.Checkpointing("all")]}``).
        mode: ``"training"`` or ``"inference"``.
        inputs: forward kwargs, a callable ``inputs(model)`` (called once, with the first model), or None for
            ``memkit.make_inputs(model, seed=seed)``; every variant runs on the same tensors.
        seed: seeds the weights of a preset, the default inputs, and the random numbers of the compared step
            (the same for every variant, so dropout does not count as a difference).
        tolerance: relative tolerance of the pass/fail column (see :class:`Comparison`).
        repeats: timed steps per variant (0 skips timing).
        progress: show a progress bar.

    Example:
        >>> cmp = memkit.compare("flux", {"checkpointing": [memkit.Checkpointing("all")]})
        >>> cmp.table()
    """
    if mode not in ("training", "inference"):
        raise ValueError(f"mode must be 'training' or 'inference', got {mode!r}")
    if not isinstance(variants, Mapping):
        raise TypeError("variants must map a name to a list of optimizations, e.g. {'ckpt': [Checkpointing()]}")
    variants = {str(k): list(v) for k, v in variants.items()}
    if "baseline" in variants:
        raise ValueError("variants must not be named 'baseline': that name is the unoptimized reference")
    if tolerance <= 0:
        raise ValueError(f"tolerance must be > 0, got {tolerance}")
    if repeats < 0:
        raise ValueError(f"repeats must be >= 0, got {repeats}")
    factory = _model_factory(model_fn, seed)
    runs = {"baseline": [], **variants}
    results: dict[str, VariantResult] = {}
    state: dict[str, torch.Tensor] | None = None
    ref_out: torch.Tensor | None = None
    ref_grads: dict[str, torch.Tensor] = {}
    step_inputs: Mapping[str, Any] | None = None
    bar = tqdm(runs.items(), desc="compare", disable=not progress, leave=False)
    for name, opts in bar:
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
        with apply_all(model, opts):
            model.zero_grad(set_to_none=True)
            captured: list[torch.Tensor] = []
            # Same random stream for every variant: dropout and label dropping (DiT) draw the same numbers.
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(seed)
                _step(model, step_inputs, mode, captured)
            out = captured[-1].clone()
            grads = _grads(model) if mode == "training" else {}
            del captured
            seconds = _time_steps(model, step_inputs, mode, repeats)
            model.zero_grad(set_to_none=True)
            with track(model, inputs=step_inputs, label=name) as tl:
                _step(model, step_inputs, mode)
        result = VariantResult(name, opts, tl, seconds)
        if ref_out is None:
            ref_out, ref_grads = out, grads
        else:
            result.max_abs_d_output = _max_abs_diff(out, ref_out)
            ok = result.max_abs_d_output <= tolerance * _scale_of(ref_out)
            if mode == "training":
                if grads.keys() != ref_grads.keys():
                    raise RuntimeError(
                        f"variant {name!r} produced gradients for different parameters than the baseline: "
                        f"{sorted(grads.keys() ^ ref_grads.keys())[:5]}"
                    )
                for k, g in grads.items():
                    d = _max_abs_diff(g, ref_grads[k])
                    result.max_abs_d_grad = max(result.max_abs_d_grad, d)
                    ok = ok and d <= tolerance * _scale_of(ref_grads[k])
            result.passed = ok
        results[name] = result
        del model
    return Comparison(results=results, mode=mode, tolerance=tolerance)


def _time_steps(model: torch.nn.Module, inputs: Mapping[str, Any], mode: str, repeats: int) -> float:
    if repeats == 0:
        return float("nan")
    times = []
    for _ in range(repeats):
        model.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        _step(model, inputs, mode)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)
