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
    timeline: Timeline, *, baseline_blocks: Iterable[tuple[int, int, int]] = (), alloc_conf: str = ""
) -> ReservedReplay:
    """Replay ``timeline``'s CUDA events through the caching allocator configured by ``alloc_conf`` (a
    ``PYTORCH_CUDA_ALLOC_CONF`` string; a bad option is a ValueError naming it) and return the reserved bytes.

    ``baseline_blocks`` are the storages live before the window, each ``(storage key, bytes, device code)``, in
    the order they were allocated; they are allocated first (the baseline's bytes are a sum, the allocator needs
    each block). A free pairs with the allocation of its storage key, else with a baseline block of its size; one
    with neither is counted in ``unmatched_frees`` and left out. Every request is on stream 0 and the device has
    no capacity limit, so nothing is released by an out-of-memory retry.

    Example:
        >>> tl = memkit.estimate("flux", size="tiny")
        >>> replay_reserved(tl, alloc_conf="expandable_segments:True").peak_bytes
    """
    # the replay makes ~10^5 small objects: the cyclic collector would scan an estimate's whole heap for them
    paused = gc.isenabled()
    gc.disable()
    try:
        return _replay(timeline, baseline_blocks, alloc_conf)
    finally:
        if paused:
            gc.enable()


def _replay(timeline: Timeline, baseline_blocks: Iterable[tuple[int, int, int]], alloc_conf: str) -> ReservedReplay:
    devices = timeline.devices
    cuda = [_is_cuda(d) for d in devices]
    allocators: dict[int, CachingAllocator] = {}
    conf_check = CachingAllocator(alloc_conf)  # validates alloc_conf even when there is nothing to replay

    def allocator(device: int) -> CachingAllocator:
        a = allocators.get(device)
        if a is None:
            a = allocators[device] = conf_check if not allocators else CachingAllocator(alloc_conf)
        return a

    live: dict[int, list] = {}  # storage key -> handles (a stack: key -1 is a kernel buffer freed at once)
    base_by_size: dict[tuple[int, int], list] = {}
    base_keys: set[int] = set()
    for key, nbytes, device in baseline_blocks:
        if device < len(cuda) and not cuda[device]:
            continue
        handle = allocator(device).malloc(int(nbytes))
        live.setdefault(key, []).append((device, handle))
        base_by_size.setdefault((device, int(nbytes)), []).append(key)
        base_keys.add(key)
    base_reserved = sum(a.reserved_bytes for a in allocators.values())

    action = timeline.column("action").tolist()
    nbytes = timeline.column("bytes").tolist()
    dev = timeline.column("device").tolist()
    storage = timeline.column("storage").tolist()
    series = np.empty(len(action), dtype=np.int64)
    reserved = {d: a.reserved_bytes for d, a in allocators.items()}
    total = base_reserved
    unmatched = 0
    for i, (act, n, d, key) in enumerate(zip(action, nbytes, dev, storage, strict=True)):
        if cuda[d]:
            a = allocator(d)
            if act == ALLOC:
                live.setdefault(key, []).append((d, a.malloc(n)))
            else:
                handles = live.get(key)
                if not handles:  # a baseline storage under another key (a spliced timeline's repeated blocks)
                    same = base_by_size.get((d, n))
                    while same and not live.get(same[-1]):
                        same.pop()
                    handles = live.get(same[-1]) if same else None
                if handles:
                    a.free(handles.pop()[1])
                else:
                    unmatched += 1
            r = a.reserved_bytes
            total += r - reserved.get(d, 0)
            reserved[d] = r
        series[i] = total
    return ReservedReplay(series, base_reserved, unmatched, alloc_conf)
