"""The steps an estimate measures: the `Step` it runs (from `estimate`'s arguments), and each measured step's peak,
allocated (`_step_peaks`) and reserved (`_reserved`: the CUDA events replayed through the caching-allocator model)."""

from __future__ import annotations

import dataclasses
from typing import Any

from .memory.reserved import replay_reserved
from .memory.timeline import Timeline
from .step import OPTIMIZERS, Step

_NO_RESERVED = dict(
    peak_reserved_bytes=None,
    first_step_peak_reserved_bytes=None,
    steady_peak_reserved_bytes=None,
    fragmentation_bytes=None,
    alloc_conf=None,
)


def _reserved(timeline: Timeline, step: Step, starts: list[int], base_blocks, alloc_conf: str) -> dict[str, Any]:
    """Replay a CUDA estimate's events through the caching allocator, attach the reserved series to ``timeline``
    and return its meta figures (see :func:`estimate`)."""
    replay = replay_reserved(timeline, baseline_blocks=base_blocks, alloc_conf=alloc_conf)
    timeline.set_reserved(replay.series, replay.baseline_bytes)
    series = replay.series
    if not step.training:
        first = steady = timeline.peak_reserved_bytes
    elif step.first_and_steady:
        first, steady = timeline.peak_reserved_between(0, starts[1]), timeline.peak_reserved_between(starts[1])
    elif step.steps == 1:
        first, steady = timeline.peak_reserved_bytes, None
    else:
        first, steady = None, timeline.peak_reserved_bytes
    peak = timeline.peak_reserved_bytes
    # reserved never falls in a replay without a capacity: its peak is a plateau, taken at its fullest moment
    at_peak = series == peak
    fullest = int(timeline.live_bytes[at_peak].max()) if at_peak.any() else 0
    if replay.baseline_bytes == peak:
        fullest = max(fullest, timeline.baseline_bytes)
    fragmentation = peak - fullest
    return dict(
        peak_reserved_bytes=peak,
        first_step_peak_reserved_bytes=first,
        steady_peak_reserved_bytes=steady,
        fragmentation_bytes=fragmentation,
        alloc_conf=alloc_conf,
        unmatched_frees=replay.unmatched_frees,
    )


def _step_peaks(timeline: Timeline, step: Step, starts: list[int]) -> tuple[int | None, int | None]:
    """(first step's peak, steady step's peak) of a tracked window, None for a step that was not measured."""
    if not step.training:  # no state lives across inference passes: each is the first and every later one
        return timeline.peak_bytes, timeline.peak_bytes
    if step.first_and_steady:
        return timeline.peak_between(0, starts[1]), timeline.peak_between(starts[1])
    return (timeline.peak_bytes, None) if step.steps == 1 else (None, timeline.peak_bytes)


def _step_of(step: Step | None, mode: str, optimizer: str | None, steps: int | None, **options: Any) -> Step:
    """The step an estimate runs: ``step``, or one built from ``mode``, ``optimizer``, ``steps`` and the recipe
    ``options`` (``grad_accum``...), which keep :class:`Step`'s defaults when ``step`` is given."""
    defaults = {f.name: f.default for f in dataclasses.fields(Step)}
    if step is None:
        if optimizer == "auto":
            optimizer = "adamw" if mode == "training" else None
        elif optimizer is not None and mode == "training" and optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer must be 'auto', one of {list(OPTIMIZERS)} or None, got {optimizer!r}")
        return Step(mode=mode, optimizer=optimizer, steps=steps, **options)  # validates each argument by name
    if not isinstance(step, Step):
        raise TypeError(f"step must be a memkit.Step or None, got {type(step).__name__}")
    given = [k for k, v in options.items() if v != defaults[k]]
    if (mode, optimizer, steps) != ("training", "auto", None) or given:
        names = "/".join(["mode", "optimizer", "steps", *options])
        raise ValueError(f"give either step or {names}, not both")
    return step
