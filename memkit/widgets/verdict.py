"""The Playground's GPU verdict: whether each estimate's peak *reserved* bytes fit the chosen GPU, in a line each.

The judging is :func:`memkit.gpus.judge`'s (the estimate does it when given ``gpu=``); here it is only redone
when the menu changes after an estimate (the peak does not change, the card does), and put in words that say which
step and which bytes, as every memkit figure does. The capacity line on the timeline is
:func:`memkit.plots.timeline_figure`'s, drawn from the same ``meta``. No widgets here.

Example:
    >>> tl = memkit.estimate("pixart", gpu="4090")
    >>> verdict_text(tl.meta)   # 'fits on NVIDIA GeForce RTX 4090: 13.51 GiB headroom (steady step, reserved bytes...)'
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from .. import gpus
from ..memory.timeline import peak_step

__all__ = ["GPU_KEYS", "gpu_options", "rejudge", "verdict_text"]

GPU_KEYS = ("gpu", "gpu_name", "usable_bytes", "fits", "verdict", "headroom_bytes")
"""What :func:`memkit.gpus.judge` writes into a timeline's ``meta``."""
_GiB = 1 << 30


def gpu_options() -> list[tuple[str, str | None]]:
    """The GPU menu: ``("none", None)``, then each card of :data:`memkit.gpus.CATALOG` (its driver name, its key)."""
    return [("none", None), *((gpu.name, key) for key, gpu in gpus.CATALOG.items())]


def rejudge(timelines: Iterable[Any], gpu: str | None) -> None:
    """Judge each timeline's peak reserved bytes against ``gpu`` (a name :func:`memkit.gpus.find` takes), or drop
    the verdict when ``gpu`` is None; timelines without reserved bytes are left as they are."""
    card = None if gpu is None else gpus.find(gpu)
    for tl in timelines:
        if tl.peak_reserved_bytes is None:
            continue
        for key in GPU_KEYS:
            tl.meta.pop(key, None)
        if card is not None:
            gpus.judge(tl, card)


def _gib(low: float, high: float | None = None) -> str:
    low_text = f"{low / _GiB:,.2f}"
    if high is None or f"{high / _GiB:,.2f}" == low_text:
        return f"{low_text} GiB"
    return f"{low_text}–{high / _GiB:,.2f} GiB"


def verdict_text(meta: Mapping[str, Any]) -> str | None:
    """One line: fits / does not fit / within the spread of the card in ``meta`` (a judged estimate's), the headroom
    or the shortfall, and which step and which bytes (reserved; the allocator settings when not torch's defaults).
    None when ``meta`` holds no verdict.

    Example:
        >>> verdict_text(memkit.estimate("flux", gpu="4090").meta)  # 'does not fit on ...: short by 98.83 GiB (...)'
    """
    status = meta.get("verdict")
    if status is None:
        return None
    low, high = meta["usable_bytes"]
    peak = low - meta["headroom_bytes"]
    name = meta["gpu_name"]
    if status == "fits":
        head = f"fits on {name}: {_gib(low - peak)} headroom"
    elif status == "does not fit":
        head = f"does not fit on {name}: short by {_gib(peak - high, peak - low)}"
    else:
        head = f"within the spread of {name}: it may or may not fit"
    conf = meta.get("alloc_conf") or ""
    bytes_ = "reserved bytes" + (f" with {conf}" if conf else ", torch's allocator defaults")
    return f"{head} ({peak_step(meta, reserved=True)}, {bytes_}: peak {_gib(peak)} of {_gib(low, high)} usable)"
