"""The estimates this process has made, kept by their arguments: a widget moving back to a setting it showed, or
the same question asked twice, is answered at once (a copy, ``meta["cached"]`` True)."""

from __future__ import annotations

import collections
import dataclasses
import os
import time

from .memory.timeline import Timeline

# Finished estimates of this process, by their arguments (least recently used first): a widget moving back to a
# setting it showed, or the same question asked twice, is answered at once. Only arguments that say everything
# about the result are keys: a preset name (not a callable, whose behaviour may change), default inputs, and
# optimizations that compare by value.
_RESULTS: collections.OrderedDict[tuple, Timeline] = collections.OrderedDict()
_RESULTS_KEPT = 64


def _cache_key(
    *, model, inputs, step, optimizations, dtype, size, batch_size, device, seed, parallel, sizes, memoize, alloc_conf
):  # fmt: skip
    if not isinstance(model, str) or inputs is not None:
        return None
    parts = []
    for o in (*optimizations, parallel):
        if o is None:
            continue
        if not dataclasses.is_dataclass(o) or type(o).__eq__ is object.__eq__:
            return None
        try:
            hash(o)
        except TypeError:
            return None
        parts.append((type(o), o))
    env = tuple(sorted((k, v) for k, v in os.environ.items() if k.startswith("MEMKIT_")))
    return (
        model,
        size,
        step,
        tuple(parts),
        dtype,
        batch_size,
        device,
        seed,
        tuple(sorted(sizes.items())),
        env,
        memoize,
        alloc_conf,
    )


def _lookup(key: tuple | None, t0: float) -> Timeline | None:
    """A copy of the estimate made earlier with these arguments (``meta["cached"]`` True), or None."""
    cached = _RESULTS.get(key) if key is not None else None
    if cached is None:
        return None
    _RESULTS.move_to_end(key)
    timeline = cached.copy()
    timeline.meta.update(cached=True, seconds=time.perf_counter() - t0)
    return timeline


def _store(key: tuple | None, timeline: Timeline) -> None:
    if key is not None:
        _RESULTS[key] = timeline.copy()
        while len(_RESULTS) > _RESULTS_KEPT:
            _RESULTS.popitem(last=False)


def clear_cache() -> None:
    """Forget the estimates this process has made (the next :func:`estimate` of each setting runs again).

    Example:
        >>> memkit.estimation.clear_cache()
    """
    _RESULTS.clear()
