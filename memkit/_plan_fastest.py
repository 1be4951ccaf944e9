"""The plan's search for the fastest configuration that fits (see :func:`memkit.planning.plan`): the search by the
prior finds the cheapest fitting configuration by the levels it switches on; what is faster on the GPU's roofline is
found here, by a lower bound of each configuration's step time from those already estimated."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ._plan_space import DIMENSIONS, conflict, rank

TIME_MONOTONE = ("quantize", "ff_split", "checkpointing")
"""The dimensions whose step time only grows with the level (:mod:`memkit.steptime`: dequantizing, more and smaller
matmuls, recomputed forwards). The others do not: 8-bit AdamW's update moves fewer bytes than AdamW's, an EMA kept
on the CPU moves none where an offloaded one moves them all, and offloading, FSDP's degree and the allocator's
settings are not held to it."""


def _time_bound(levels: dict[str, Any], seen: Mapping[tuple, list[Any]], space) -> float:
    """A lower bound of ``levels``'s step time: the longest of the estimated configurations that switch on no more of
    each :data:`TIME_MONOTONE` dimension and the same of every other (0 where there is none); one estimated before a
    dimension left the search counts where it had that dimension off."""
    bound = 0.0
    for cands in seen.values():
        c = cands[0]
        if c.step_seconds is None or not levels.keys() <= c.levels.keys():
            continue
        if any(c.levels[d] != space[d][0] for d in c.levels.keys() - levels.keys()):
            continue  # a dimension that has left the search since (a refused one), switched on in ``c``
        if all(
            rank(d, c.levels[d], space[d]) <= rank(d, v, space[d]) if d in TIME_MONOTONE else c.levels[d] == v
            for d, v in levels.items()
        ):
            bound = max(bound, c.step_seconds)
    return bound


def fastest_fitting(tried) -> float:
    """The shortest step time of the configurations estimated so far that fit (inf where none has one)."""
    return min((c.step_seconds for c in tried if c.fits and c.step_seconds is not None), default=float("inf"))


def fastest(grid, space, pinned, seen, tried, evaluate, failed_above) -> None:
    """Estimate every configuration of ``grid`` (cheapest by the prior first) that could fit and could be faster
    than the fastest fitting one found so far, by :func:`_time_bound`: then the fastest that fits in ``tried`` is the
    grid's (as far as the :data:`TIME_MONOTONE` premise holds; ``tests/test_plan.py`` holds it to brute force)."""
    best = fastest_fitting(tried)
    if best == float("inf"):
        return
    for levels in grid:
        if tuple(levels.get(d) for d in DIMENSIONS) in seen or conflict(levels, pinned) is not None:
            continue
        if failed_above(levels) or _time_bound(levels, seen, space) >= best:
            continue
        try:
            cands = evaluate(levels)
        except (ValueError, NotImplementedError):  # a combination the library refuses: not a configuration
            continue
        best = min([best, *(c.step_seconds for c in cands if c.fits)])
