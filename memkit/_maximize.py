"""The largest work that fits a GPU with a fixed configuration: a batch size, a resolution or a frame count, found by a
bisection on estimates (:func:`maximize`; ``memkit plan --maximize``)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from . import gpus

__all__ = ["MAXIMIZE", "Largest", "maximize"]


MAXIMIZE = ("batch", "resolution", "frames")
"""What :func:`maximize` can grow: the batch size, the image size (height, the width keeping the preset's aspect) or
the frame count of a video preset."""


@dataclasses.dataclass(frozen=True)
class Largest:
    """The largest work that fits a GPU with a fixed configuration (see :func:`maximize`).

    Example:
        >>> big = memkit.planning.maximize("flux", "4090", "batch", optimizations=[memkit.LoRA(rank=16)])
        >>> big.value, big.peak_reserved_bytes / 2**30, big.headroom_bytes / 2**30
    """

    what: str
    value: int | None
    """The largest batch size, height (pixels) or frame count that fits; None when even the smallest does not."""
    sizes: dict[str, int]
    """The input sizes at ``value`` (``height`` and ``width`` for a resolution)."""
    peak_reserved_bytes: int | None
    headroom_bytes: int | None
    tried: tuple[tuple[int, int, bool], ...]
    """``(value, peak reserved bytes, fits)`` for each estimate, in the order run."""

    def summary(self) -> dict[str, Any]:
        return dict(
            maximize=self.what, value=self.value, sizes=self.sizes, peak_reserved_bytes=self.peak_reserved_bytes,
            headroom_bytes=self.headroom_bytes, estimates=len(self.tried),
            tried=[dict(value=v, peak_reserved_bytes=r, fits=f) for v, r, f in self.tried],
        )  # fmt: skip


def maximize(
    model: str,
    gpu: str | gpus.GPU,
    what: str,
    *,
    optimizations: Sequence = (),
    size: str = "full",
    limit: int = 4096,
    progress: Callable[[str], None] | None = None,
    **estimate_kwargs: Any,
) -> Largest:
    """The largest batch size, resolution or frame count whose step fits ``gpu`` with ``optimizations`` fixed: the
    value doubled from the preset's default (or 1 for the batch) until the peak reserved bytes pass the usable ones,
    then bisected, on the sizes the preset accepts (multiples of its VAE and patch, 4k+1 frames...). Peaks grow with
    each of them, so the bisection's answer is the largest that fits.

    Args:
        model: a preset name.
        gpu: a GPU of :mod:`memkit.gpus`.
        what: one of :data:`MAXIMIZE`.
        optimizations, size, estimate_kwargs: :func:`memkit.estimate`'s (device is cuda).
        limit: the largest value tried (a batch of 4096, 4096 pixels, 4096 frames by default).

    Example:
        >>> memkit.planning.maximize("wan", "h100", "frames", optimizations=[memkit.Checkpointing()]).value
    """
    from .estimation import estimate
    from .models import PRESETS, load_model, make_inputs

    if what not in MAXIMIZE:
        raise ValueError(f"what must be one of {list(MAXIMIZE)}, got {what!r}")
    if model not in PRESETS:
        raise ValueError(f"maximize grows a preset's inputs; {model!r} is not a preset: one of {list(PRESETS)}")
    card = gpus.find(gpu)
    defaults = {**PRESETS[model].input_sizes[size], **{k: v for k, v in estimate_kwargs.items() if k in _SIZE_KEYS}}
    if what == "frames" and "frames" not in defaults:
        raise ValueError(f"{model} is an image model: it has no frames to grow (maximize batch or resolution)")
    if what == "resolution" and "height" not in defaults:
        raise ValueError(f"{model} takes no height and width to grow")
    rest = {k: v for k, v in estimate_kwargs.items() if k not in _SIZE_KEYS and k != "batch_size"}
    if "device" in rest or "gpu" in rest:
        raise ValueError("maximize estimates for the GPU it is given: leave device and gpu out")
    tiny = load_model(model, size="tiny")
    key = {"resolution": "height", "frames": "frames"}.get(what)
    step, offset = _grid(tiny, key, defaults, make_inputs) if key else (1, 0)

    def sizes_at(v: int) -> tuple[dict[str, int], int]:
        if what == "batch":
            return dict(defaults), v
        if what == "frames":
            return {**defaults, "frames": v}, estimate_kwargs.get("batch_size", 1)
        aspect = defaults["width"] / defaults["height"]
        width = max(step, round(v * aspect / step) * step)
        return {**defaults, "height": v, "width": width}, estimate_kwargs.get("batch_size", 1)

    tried: list[tuple[int, int, bool]] = []

    def fits(v: int) -> bool:
        sizes, batch = sizes_at(v)
        if progress is not None:
            progress(f"estimating {what} {v}")
        tl = estimate(model, size=size, optimizations=list(optimizations), batch_size=batch, device="cuda",
                      progress=False, **rest, **sizes)  # fmt: skip
        ok = gpus.verdict(tl.peak_reserved_bytes, card).fits
        tried.append((v, tl.peak_reserved_bytes, ok))
        return ok

    # values on the preset's grid: offset + step * k
    def value(k: int) -> int:
        return offset + step * k

    if what == "batch":
        k_lo = 1
    else:
        k_lo = max(1, (defaults[key] - offset) // step)
    lo = None  # the largest k known to fit
    k = k_lo
    if not fits(value(k)):  # shrink from the default: halve until something fits
        hi = k
        while k > 1:
            k //= 2
            if fits(value(k)):
                lo = k
                break
            hi = k
        if lo is None:
            return Largest(what, None, {}, None, None, tuple(tried))
    else:
        lo, hi = k, None
        top = (limit - offset) // step  # the largest k within the limit
        while hi is None:
            nxt = min(lo * 2, top + 1)
            if nxt > top:  # past the limit: taken as not fitting
                hi = nxt
            elif fits(value(nxt)):
                lo = nxt
            else:
                hi = nxt
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(value(mid)):
            lo = mid
        else:
            hi = mid
    best = value(lo)
    reserved = next(r for v, r, ok in reversed(tried) if v == best and ok)
    sizes, batch = sizes_at(best)
    shown = sizes if what != "batch" else {"batch_size": batch}
    return Largest(what, best, shown, reserved, gpus.verdict(reserved, card).headroom_bytes, tuple(tried))


_SIZE_KEYS = ("height", "width", "frames", "text_len")


def _grid(tiny, key: str, defaults: dict[str, int], make_inputs) -> tuple[int, int]:
    """The values of ``key`` the preset accepts, ``offset + step * k``: read from the refusal of a value off the grid
    (``must be a multiple of N``; ``must be T*k+1``), on the preset's tiny model."""
    import re

    try:
        make_inputs(tiny, **{**defaults, key: defaults[key] + 1})
    except ValueError as e:
        m = re.search(r"must be a multiple of (\d+)", str(e))
        if m:
            return int(m.group(1)), 0
        m = re.search(r"must be (\d+)\*k\+1", str(e))
        if m:
            return int(m.group(1)), 1
        raise
    return 1, 0
