"""The Playground's Fit to GPU: :func:`memkit.plan` run on the Playground's settings, and the plan's choice as the
settings to show. No widgets here (``fit_button.py`` is the button).

The plan chooses what it searches (:data:`memkit.planning.DIMENSIONS`: checkpointing, FF split, quantize in LoRA runs,
AdamW or 8-bit AdamW; and the allocator settings). Everything else the Playground holds stays fixed: the preset, its
estimate size and input sizes, the batch, dtype and seed, the steps measured, the recipe (grad accum, mixed precision,
fused backward, where the optimizer lives) and every other optimization switched on (LoRA with its rank and settings,
an EMA, offload, FSDP). What the Playground holds for a searched dimension is no input: the plan overwrites it.
A dimension whose panel the Playground lacks (a registry of its own) is left out of the search, and the result says
so. It costs what the plan costs: a few estimates at the estimate size (full Flux with LoRA: ~30 s).

Example:
    >>> state = PlaygroundState(preset="flux", estimate_size="tiny", gpu="0.5GiB", sizes=...)
    >>> result = fit(state, on_progress=lambda n, most, line: print(n, line))
    >>> result.plan.best.flags, result.settings
"""

from __future__ import annotations

import math
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from ._watch import Stopped, watching

__all__ = ["DIMENSION_PANELS", "FitResult", "FitSettings", "fit", "plan_arguments"]

DIMENSION_PANELS = {"quantize": "quantize", "ff_split": "ff-split", "checkpointing": "checkpointing"}
"""The plan's dimensions that a panel shows (the registry entry's name); ``optimizer`` and ``alloc_conf`` are the
model controls of the same names."""

FitProgress = Callable[[int, int, str], Any]


@dataclass(frozen=True)
class FitSettings:
    """The configuration the plan chose, as the Playground's settings hold it.

    Example:
        >>> fit(state).settings
        FitSettings(optimizer='adamw', alloc_conf='', panels={'checkpointing': Checkpointing(...), 'ff-split': None})
    """

    optimizer: str
    """The optimizer menu's value."""
    alloc_conf: str
    """The allocator box's value (empty: torch's defaults)."""
    panels: dict[str, Any]
    """For each searched dimension's panel: the config to show, switched on, or None: switched off."""


@dataclass
class FitResult:
    """What Fit to GPU found: the plan and the settings to show, or why there are none.

    Example:
        >>> result = fit(state)
        >>> result.ok, result.message, result.plan.best.peak_reserved_bytes
    """

    status: Literal["ok", "nothing fits", "refused", "stopped", "error"]
    """``"ok"``; ``"nothing fits"`` (:class:`memkit.planning.NothingFits`, its message in ``message``); ``"refused"``:
    the settings cannot be planned (no GPU, an inference step...); ``"stopped"`` on request; ``"error"``."""
    message: str = ""
    plan: Any = None
    """The :class:`memkit.planning.Plan` when ``status == "ok"``."""
    settings: FitSettings | None = None
    notes: list[str] = field(default_factory=list)
    """The dimensions left out of the search, each with why."""
    estimates: int = 0
    """Estimates the search started."""
    seconds: float = 0.0
    warnings: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.status == "ok"


def plan_arguments(state: Any) -> tuple[dict[str, Any], list[str]]:
    """The :func:`memkit.plan` arguments for ``state`` (a :class:`~memkit.widgets.state.PlaygroundState`), and a note
    for each searched dimension it has no panel for. A ValueError says why the settings cannot be planned.

    Example:
        >>> kwargs, notes = plan_arguments(PlaygroundState(preset="flux", gpu="4090"))
        >>> kwargs["search"], kwargs["optimizations"]
    """
    from ..planning import DIMENSIONS

    if state.gpu is None:
        raise ValueError("Fit to GPU needs a GPU: choose one in the GPU menu (a card, or a size such as 24GiB)")
    state._check()
    if state.mode != "training":
        raise ValueError(f"Fit to GPU plans a training step: set step to training, not {state.mode!r}")
    if state.optimizer not in DIMENSIONS["optimizer"]:
        raise ValueError(
            f"Fit to GPU chooses the optimizer among {list(DIMENSIONS['optimizer'])}; the optimizer menu holds "
            f"{state.optimizer!r}: pick one of them"
        )
    if (state.text_encoders, state.vae) != ("precomputed", "precomputed"):
        raise ValueError(
            "Fit to GPU plans the training step alone: set text enc. and VAE to precomputed (Estimate shows the "
            "job with them placed)"
        )
    missing = [d for d, name in DIMENSION_PANELS.items() if name not in state.optimizations]
    notes = [f"{d} not searched: this Playground has no {DIMENSION_PANELS[d]} panel" for d in missing]
    searched = set(DIMENSION_PANELS.values())
    fixed = [s.config() for name, s in state.optimizations.items() if s.enabled and name not in searched]
    lora = any(type(o).__name__ == "LoRA" for o in fixed)
    # the dimensions with a control here; a quantized base in LoRA runs only; a fixed EMA's placement, FSDP and
    # offloading stay as set (no control to show the plan's choice in, one GPU)
    search = [d for d in DIMENSIONS if d == "optimizer" or (d in DIMENSION_PANELS and d not in missing)]
    if not lora and "quantize" in search:
        search.remove("quantize")
        notes.append("quantize not searched (LoRA runs only: switch lora on to search it)")
    step = state.step()
    kwargs = dict(
        model=state.preset, gpu=state.gpu, optimizations=fixed, search=search,
        size=state.estimate_size, dtype=state._torch_dtype(), batch_size=state.batch_size, seed=state.seed,
        steps=state.steps, grad_accum=step.grad_accum, mixed_precision=step.mixed_precision,
        fused_backward=step.fused_backward, optimizer_on=step.optimizer_on, offload_gradients=step.offload_gradients,
        **state.input_sizes(),
    )  # fmt: skip
    return kwargs, notes


def fit(state: Any, *, on_progress: FitProgress | None = None) -> FitResult:
    """Run :func:`memkit.plan` on ``state``'s settings (:func:`plan_arguments`) and read its best configuration as
    :class:`FitSettings`; ``state`` itself is not changed. ``on_progress(n, at_most, line)`` gets the plan's line
    for each estimate it starts (``at_most``: the search's grid, which it prunes). A stop request
    (``state.request_stop()``) ends the search between two ops. Failures come back as a :class:`FitResult`.

    Example:
        >>> result = fit(PlaygroundState(preset="flux", gpu="4090", estimate_size="tiny"))
        >>> result.settings.panels["checkpointing"]
    """
    from ..planning import DIMENSIONS, NothingFits, plan
    from .state import _message

    if not state._busy.acquire(blocking=False):
        return FitResult("error", "a run is in progress: wait for it to finish or press Stop")
    t0 = time.perf_counter()
    state._stop.clear()
    result = FitResult("error")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                kwargs, result.notes = plan_arguments(state)
                at_most = math.prod(len(DIMENSIONS[d]) for d in kwargs["search"])

                def progress(line: str) -> None:
                    result.estimates += 1
                    if on_progress is not None:
                        on_progress(result.estimates, at_most, line)
                    if state._stop.is_set():  # asked for between two estimates (inside one: `watching` stops it)
                        raise Stopped("stopped on request")

                state._import_model_class()
                with watching(should_stop=state._stop.is_set):
                    found = plan(**kwargs, progress=progress)
                if found.interrupted:
                    raise Stopped("stopped on request")
                result.plan, result.settings = found, _settings(state, found)
                result.notes += _left_out(found, kwargs["search"])
                result.status = "ok"
            except Stopped:
                result.status = "stopped"
                result.message = f"stopped on request at estimate {result.estimates}: no setting changed"
            except NothingFits as e:
                result.status, result.message = "nothing fits", str(e)
            except ValueError as e:
                if result.estimates == 0:  # the settings, before any estimate
                    result.status, result.message = "refused", str(e)
                else:  # an estimate's own refusal
                    result.status, result.message = "error", _message(e, "estimate")
            except Exception as e:  # every failure is a message in the app; the kernel lives on
                result.status, result.message = "error", _message(e, "estimate")
        for w in caught:
            text = f"{w.category.__name__}: {w.message}"
            if text not in result.warnings:
                result.warnings.append(text)
    finally:
        result.seconds = time.perf_counter() - t0
        state._stop.clear()
        state._busy.release()
    return result


def _settings(state: Any, found: Any) -> FitSettings:
    best = found.best
    panels = {}
    for dim, name in DIMENSION_PANELS.items():
        if name not in state.optimizations:
            continue
        config = state.optimizations[name].spec.config
        on = best.levels.get(dim) is not None
        panels[name] = next(o for o in best.optimizations if isinstance(o, config)) if on else None
    return FitSettings(best.levels.get("optimizer", "adamw"), best.alloc_conf, panels)


def _left_out(found: Any, search: list[str]) -> list[str]:
    """A note for each searched dimension the plan did not search (it is off in the settings)."""
    notes = [f"{d} not searched: the fixed settings refuse it ({why})" for d, why in found.refused.items()]
    for d in search:
        if d not in found.best.levels and d not in found.refused:
            notes.append(f"{d} not searched (FSDP refuses a quantized base)")
    return notes
