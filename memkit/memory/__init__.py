"""Measurement only: the event schema, the Timeline, the live-storage tracker, kernel-internal buffers, CUDA
allocator history, and snapshots read and written safely.

The Timeline and the schema need only numpy; the tracker, CUDA history and snapshots are imported on first use.

Example:
    >>> from memkit.memory import track, Timeline
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .events import CATEGORIES, PHASES
from .timeline import Timeline

_EXPORTS = {
    "AllocatorWindow": ".allocator",
    "allocator_window": ".allocator",
    "CudaHistory": ".cuda",
    "CudaHistoryError": ".cuda",
    "cuda_history_available": ".cuda",
    "cuda_snapshot": ".cuda",
    "record_cuda_history": ".cuda",
    "SnapshotError": ".snapshot",
    "load_snapshot": ".snapshot",
    "read_snapshot": ".snapshot",
    "RSSSamples": ".rss",
    "rss_bytes": ".rss",
    "sample_rss": ".rss",
    "write_snapshot": ".snapshot_write",
    "Tracker": ".tracker",
    "off_device": ".tracker",
    "phase": ".tracker",
    "tag": ".tracker",
    "track": ".tracker",
    "tracking": ".tracker",
}

__all__ = [
    "AllocatorWindow",
    "CATEGORIES",
    "CudaHistory",
    "CudaHistoryError",
    "PHASES",
    "RSSSamples",
    "SnapshotError",
    "Timeline",
    "Tracker",
    "allocator_window",
    "cuda_history_available",
    "cuda_snapshot",
    "load_snapshot",
    "off_device",
    "phase",
    "read_snapshot",
    "record_cuda_history",
    "rss_bytes",
    "sample_rss",
    "tag",
    "track",
    "tracking",
    "write_snapshot",
]

if TYPE_CHECKING:
    from .allocator import AllocatorWindow, allocator_window
    from .cuda import CudaHistory, CudaHistoryError, cuda_history_available, cuda_snapshot, record_cuda_history
    from .rss import RSSSamples, rss_bytes, sample_rss
    from .snapshot import SnapshotError, load_snapshot, read_snapshot
    from .snapshot_write import write_snapshot
    from .tracker import Tracker, off_device, phase, tag, track, tracking


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'memkit.memory' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name], __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
