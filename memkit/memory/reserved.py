"""Reserved bytes of a CUDA timeline: its events replayed through the caching-allocator model.

A :class:`~memkit.memory.timeline.Timeline` counts *allocated* bytes (``max_memory_allocated``); a GPU runs out of
memory on *reserved* bytes (``max_memory_reserved``): the allocated blocks plus the cached free blocks and the
unusable tails of the segments the allocator holds. :func:`replay_reserved` feeds the baseline's storages and then
every event on a CUDA device, in order, to :class:`~memkit.memory.caching_allocator.CachingAllocator` (one per
device) and returns the reserved bytes after each event. Events on other devices (host, disk) are left out. The
replay costs a few microseconds an event; it models no CUDA context and no cuBLAS/cuDNN workspace (outside the
allocator).
"""

from __future__ import annotations

import gc
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from .caching_allocator import CachingAllocator
from .events import ALLOC
from .timeline import Timeline

__all__ = ["ReservedReplay", "replay_reserved"]


@dataclass(frozen=True)
class ReservedReplay:
    """What a replay gives: ``series`` (reserved bytes after each event, int64, the CUDA devices summed),
    ``baseline_bytes`` (reserved once the baseline's storages are allocated, before the first event),
    ``unmatched_frees`` (frees whose allocation the replay never saw: left out) and ``alloc_conf``.

    Example:
        >>> r = replay_reserved(tl, baseline_blocks=[(1, 3 << 20, 0)])
        >>> r.baseline_bytes >> 20   # a 3 MiB request takes a 20 MiB segment
        20
    """

    series: np.ndarray
    baseline_bytes: int
    unmatched_frees: int
    alloc_conf: str

    @property
    def peak_bytes(self) -> int:
        """The highest reserved bytes over the window, the baseline's included.

        Example:
            >>> replay_reserved(tl).peak_bytes
        """
        return max(self.baseline_bytes, int(self.series.max())) if len(self.series) else self.baseline_bytes


def _is_cuda(name: str) -> bool:
    return name == "cuda" or name.startswith("cuda:")


def replay_reserved(
    timeline: Timeline,
    *,
    baseline_blocks: Iterable[tuple[int, int, int]] = (),
    alloc_conf: str = "",
    empty_cache_at: Iterable[int] = (),
) -> ReservedReplay:
    """Replay ``timeline``'s CUDA events through the caching allocator configured by ``alloc_conf`` (a
    ``PYTORCH_CUDA_ALLOC_CONF`` string; a bad option is a ValueError naming it) and return the reserved bytes.

    ``baseline_blocks`` are the storages live before the window, each ``(storage key, bytes, device code)``, in
    the order they were allocated; they are allocated first (the baseline's bytes are a sum, the allocator needs
    each block). A free pairs with the allocation of its storage key, else with a baseline block of its size; one
    with neither is counted in ``unmatched_frees`` and left out. Every request is on stream 0 and the device has
    no capacity limit, so nothing is released by an out-of-memory retry. ``empty_cache_at``: event indices before
    which ``torch.cuda.empty_cache()`` runs (the cached free segments given back: a script's ``free_memory()``).

    Example:
        >>> tl = memkit.estimate("flux", size="tiny")
        >>> replay_reserved(tl, alloc_conf="expandable_segments:True").peak_bytes
    """
    # the replay makes ~10^5 small objects: the cyclic collector would scan an estimate's whole heap for them
    paused = gc.isenabled()
    gc.disable()
    try:
        return _replay(timeline, baseline_blocks, alloc_conf, frozenset(empty_cache_at))
    finally:
        if paused:
            gc.enable()


def _replay(
    timeline: Timeline, baseline_blocks: Iterable[tuple[int, int, int]], alloc_conf: str, empty_at: frozenset[int]
) -> ReservedReplay:
    CachingAllocator(alloc_conf)  # validates alloc_conf even when there is nothing to replay
    allocators = [CachingAllocator(alloc_conf) if _is_cuda(d) else None for d in timeline.devices]
    live: dict[int, tuple] = {}  # storage key -> (allocator, handle)
    stacked: dict[int, list] = {}  # keys allocated again while live (key -1: kernel buffers freed at once)
    base_by_size: dict[tuple[int, int], list[int]] = {}

    def free(key: int, n: int, d: int) -> bool:
        """Free ``key``'s block, or a baseline block of ``n`` bytes (a spliced timeline's repeated blocks)."""
        entry = live.pop(key, None)
        if entry is None:
            same = base_by_size.get((d, n))
            while same and same[-1] not in live:
                same.pop()
            if not same:
                return False
            entry = live.pop(same.pop())
        elif key in stacked:
            live[key] = stacked[key].pop()
            if not stacked[key]:
                del stacked[key]
        entry[0].free(entry[1])
        return True

    def malloc(key: int, n: int, a: CachingAllocator) -> None:
        entry = (a, a.malloc(n))
        if key in live:
            stacked.setdefault(key, []).append(live[key])
        live[key] = entry

    for key, nbytes, device in baseline_blocks:
        a = allocators[device] if device < len(allocators) else None
        if a is not None:
            malloc(key, int(nbytes), a)
            base_by_size.setdefault((device, int(nbytes)), []).append(key)
    base_reserved = total = sum(a.reserved_bytes for a in allocators if a is not None)

    columns = (timeline.column(c).tolist() for c in ("action", "bytes", "device", "storage"))
    series: list[int] = []
    append = series.append
    unmatched = 0
    for i, (act, n, d, key) in enumerate(zip(*columns, strict=True)):
        if i in empty_at:
            for x in allocators:
                if x is not None:
                    total -= x.reserved_bytes
                    x.empty_cache()
                    total += x.reserved_bytes
        a = allocators[d]
        if a is not None:
            before = a.reserved_bytes
            if act == ALLOC:
                malloc(key, n, a)
            elif not free(key, n, d):
                unmatched += 1
            total += a.reserved_bytes - before
        append(total)
    return ReservedReplay(np.array(series, dtype=np.int64), base_reserved, unmatched, alloc_conf)
