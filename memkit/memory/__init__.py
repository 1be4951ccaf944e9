"""Measurement only: the event schema, the Timeline, the live-storage tracker, kernel-internal buffers, CUDA
allocator history, a model of the CUDA caching allocator (and a real trace replayed through it), and snapshots read
and written safely.

The Timeline and the schema need only numpy; the tracker, CUDA history and snapshots are imported on first use.

Example:
    >>> from memkit.memory import track, Timeline
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._lazy import lazy_exports
from .events import CATEGORIES, PHASES
from .timeline import Timeline

_EXPORTS = {
    "AllocatorWindow": ".allocator",
    "CachingAllocator": ".caching_allocator",
    "DeviceOutOfMemoryError": ".caching_allocator",
    "allocator_window": ".allocator",
    "CudaHistory": ".cuda",
    "CudaHistoryError": ".cuda",
    "cuda_history_available": ".cuda",
    "cuda_snapshot": ".cuda",
    "record_cuda_history": ".cuda",
    "SnapshotError": ".snapshot",
    "load_snapshot": ".snapshot",
    "read_snapshot": ".snapshot",
    "DeviceReplay": ".trace_replay",
    "ReservedReplay": ".reserved",
    "replay_reserved": ".reserved",
    "replay_trace": ".trace_replay",
    "RSSSamples": ".rss",
    "rss_bytes": ".rss",
    "sample_rss": ".rss",
    "write_snapshot": ".snapshot_write",
    "Tracker": ".tracker",
    "current_timeline": ".recording",
    "host_state": ".tracker",
    "off_device": ".tracker",
    "phase": ".recording",
    "released": ".recording",
    "tag": ".recording",
    "track": ".recording",
    "tracking": ".recording",
}

__all__ = [
    "AllocatorWindow",
    "CATEGORIES",
    "CachingAllocator",
    "CudaHistory",
    "CudaHistoryError",
    "DeviceOutOfMemoryError",
    "DeviceReplay",
    "PHASES",
    "RSSSamples",
    "ReservedReplay",
    "SnapshotError",
    "Timeline",
    "Tracker",
    "allocator_window",
    "cuda_history_available",
    "cuda_snapshot",
    "current_timeline",
    "host_state",
    "load_snapshot",
    "off_device",
    "phase",
    "read_snapshot",
    "record_cuda_history",
    "released",
    "replay_reserved",
    "replay_trace",
    "rss_bytes",
    "sample_rss",
    "tag",
    "track",
    "tracking",
    "write_snapshot",
]

if TYPE_CHECKING:
    from .allocator import AllocatorWindow, allocator_window
    from .caching_allocator import CachingAllocator, DeviceOutOfMemoryError
    from .cuda import CudaHistory, CudaHistoryError, cuda_history_available, cuda_snapshot, record_cuda_history
    from .recording import current_timeline, phase, released, tag, track, tracking
    from .reserved import ReservedReplay, replay_reserved
    from .rss import RSSSamples, rss_bytes, sample_rss
    from .snapshot import SnapshotError, load_snapshot, read_snapshot
    from .snapshot_write import write_snapshot
    from .trace_replay import DeviceReplay, replay_trace
    from .tracker import Tracker, host_state, off_device


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, __all__)
