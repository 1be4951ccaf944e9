"""`Timeline`'s reserved bytes: the series a replay of the CUDA caching allocator attaches to a CUDA estimate
(:func:`memkit.memory.reserved.replay_reserved`), beside the allocated bytes the events give."""

from __future__ import annotations

import numpy as np


class _Reserved:
    """The reserved-bytes half of `Timeline` (a mix-in: ``self._reserved`` is ``(series, baseline)`` or None)."""

    _reserved: tuple[np.ndarray, int] | None = None

    def set_reserved(self, series: np.ndarray, baseline_bytes: int) -> None:
        """Attach the caching allocator's reserved bytes: ``series`` after each event (int64, one per event) and
        ``baseline_bytes`` before the first. :func:`memkit.estimate` does it for ``device="cuda"`` (see
        :func:`memkit.memory.reserved.replay_reserved`).

        Example:
            >>> r = replay_reserved(tl); tl.set_reserved(r.series, r.baseline_bytes)
        """
        series = np.asarray(series, dtype=np.int64)
        if len(series) != len(self):
            raise ValueError(f"series has {len(series)} values, expected one per event ({len(self)})")
        series = series.view()
        series.flags.writeable = False
        self._reserved = (series, int(baseline_bytes))

    @property
    def reserved_bytes(self) -> np.ndarray | None:
        """Reserved bytes after each event (int64, beside :attr:`live_bytes`): the segments the CUDA caching
        allocator holds, cached free blocks included. None where no allocator was replayed (a CPU estimate, a
        tracked run, a snapshot).

        Example:
            >>> tl = memkit.estimate("flux"); (tl.reserved_bytes - tl.live_bytes).max()   # most cached at once
        """
        return None if self._reserved is None else self._reserved[0]

    @property
    def baseline_reserved_bytes(self) -> int | None:
        """Reserved bytes before the first event (the baseline's storages allocated), or None (no replay).

        Example:
            >>> tl.baseline_reserved_bytes >= tl.baseline_bytes
            True
        """
        return None if self._reserved is None else self._reserved[1]

    @property
    def peak_reserved_bytes(self) -> int | None:
        """Highest reserved bytes over the window (``max_memory_reserved``: what a GPU runs out of), the
        baseline's included; over every step the timeline covers. None where no allocator was replayed.

        Example:
            >>> tl = memkit.estimate("flux"); tl.peak_reserved_bytes - tl.peak_bytes   # the allocator's cache
        """
        if self._reserved is None:
            return None
        series, base = self._reserved
        return max(base, int(series.max())) if len(series) else base

    def peak_reserved_between(self, start: int, stop: int | None = None) -> int | None:
        """Highest reserved bytes over the events ``start`` to ``stop`` (exclusive; None: the end), counting what
        was reserved when event ``start`` happens (reserved is cumulative: a later step starts with the cache an
        earlier one left). None where no allocator was replayed.

        Example:
            >>> tl.peak_reserved_between(tl.meta["step_starts"][1])   # the steady step's reserved peak
        """
        if self._reserved is None:
            return None
        series, base = self._reserved
        stop = len(series) if stop is None else stop
        if not 0 <= start <= stop <= len(series):
            raise IndexError(f"start and stop must satisfy 0 <= start <= stop <= {len(series)}, got {start}, {stop}")
        before = base if start == 0 else int(series[start - 1])
        return max(before, int(series[start:stop].max())) if stop > start else before
