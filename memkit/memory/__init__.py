"""Exact memory timelines: the event schema, the live-storage tracker, fake-tensor estimates and snapshots."""

from .cuda import CudaHistoryError, cuda_history_available, cuda_snapshot, record_cuda_history
from .events import CATEGORIES, PHASES
from .snapshot import SnapshotError, load_snapshot, read_snapshot
from .snapshot_write import write_snapshot
from .timeline import Timeline
from .tracker import Tracker, phase, tag, track, tracking

__all__ = [
    "CATEGORIES",
    "PHASES",
    "CudaHistoryError",
    "SnapshotError",
    "Timeline",
    "Tracker",
    "cuda_history_available",
    "cuda_snapshot",
    "load_snapshot",
    "phase",
    "read_snapshot",
    "record_cuda_history",
    "tag",
    "track",
    "tracking",
    "write_snapshot",
]
