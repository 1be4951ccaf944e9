"""The CPU allocator's own count over a window, from ``torch.profiler``: an independent check of memkit's numbers.

The tracker counts storages; the profiler (``profile_memory=True``) records every allocation and free the
allocator makes, including ones freed before the window ends, which a before/after look at the process (RSS)
cannot see. :func:`allocator_window` turns that record into the highest and the final bytes above the start.

Example:
    >>> with memkit.memory.allocator_window() as window:
    ...     tl = memkit.estimate("flux", size="small")
    >>> window.peak_bytes     # a few KiB: fake tensors allocate nothing
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass

from .. import _torch_compat as _compat

__all__ = ["AllocatorWindow", "allocator_window"]


@dataclass
class AllocatorWindow:
    """What the allocator did over a window, relative to its start; filled in when the window closes.

    Example:
        >>> with memkit.memory.allocator_window() as window:
        ...     x = torch.empty(2**20, dtype=torch.uint8); del x
        >>> window.peak_bytes, window.end_bytes      # (1048576, 0)
    """

    device: str = "cpu"
    """The device type whose allocations are counted (``"cpu"`` or ``"cuda"``)."""
    peak_bytes: int = 0
    """The highest bytes allocated and not yet freed at any moment of the window, above the start."""
    end_bytes: int = 0
    """Bytes allocated in the window and still live at its end (negative if it freed older memory)."""
    allocations: int = 0
    """How many allocations the window made."""


@contextlib.contextmanager
def _native_stderr_quiet() -> Iterator[None]:
    """Send what C++ writes to file descriptor 2 to /dev/null for the block (Python's own stderr is kept)."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "wb") as devnull:
            os.dup2(devnull.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


@contextlib.contextmanager
def allocator_window(device: str = "cpu") -> Iterator[AllocatorWindow]:
    """Measure the allocator over the ``with`` block with ``torch.profiler`` (``profile_memory=True``).

    Sees every allocation of ``device``'s allocator, also the ones freed inside the block. The profiler
    slows the block down (it records every op); use it to check, not around a timed step.

    Example:
        >>> with memkit.memory.allocator_window() as window:
        ...     memkit.train_step(model, inputs)
        >>> window.peak_bytes / 2**20, "MiB"
    """
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
    from torch.profiler import ProfilerActivity, profile

    window = AllocatorWindow(device=device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    prof = profile(activities=activities, profile_memory=True)
    with _native_stderr_quiet():  # kineto prints "profiler_start" / "profiler_stop" lines from C++
        prof.start()
    try:
        yield window
    finally:
        with _native_stderr_quiet():
            prof.stop()
    events = _compat.profiler_allocations(prof, device)
    events.sort(key=lambda e: e[0])  # stable: an alloc and its free at the same instant keep their order
    live = peak = 0
    for _, size in events:
        live += size
        peak = max(peak, live)
    window.peak_bytes, window.end_bytes = peak, live
    window.allocations = sum(1 for _, size in events if size > 0)
