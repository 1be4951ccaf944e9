"""The process's resident memory (RSS) over time, sampled on a background thread.

The tracker counts the storages torch allocates; RSS is what the operating system gives the process, and is
what drops when weights live on disk instead of in RAM (``memkit.Offload(to="disk")``: offloaded weights are
``parameter`` bytes that are not resident). Sampling costs a read of ``/proc/self/statm`` (Linux; ``psutil``
elsewhere) per interval; a peak shorter than the interval can be missed.

Example:
    >>> with memkit.memory.sample_rss() as rss:
    ...     model(**inputs)
    >>> rss.peak_bytes, rss.times, rss.bytes
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

__all__ = ["RSSSamples", "rss_bytes", "sample_rss"]

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def rss_bytes() -> int:
    """The process's resident memory now, in bytes.

    Example:
        >>> before = rss_bytes()
    """
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * _PAGE
    except OSError:
        import psutil

        return psutil.Process().memory_info().rss


@dataclass
class RSSSamples:
    """RSS samples: ``times`` (seconds from the start) and ``bytes``, the first taken before the block ran."""

    times: list[float] = field(default_factory=list)
    bytes: list[int] = field(default_factory=list)

    @property
    def peak_bytes(self) -> int:
        return max(self.bytes, default=0)

    @property
    def start_bytes(self) -> int:
        return self.bytes[0] if self.bytes else 0


@contextmanager
def sample_rss(interval: float = 0.001) -> Iterator[RSSSamples]:
    """Sample RSS every ``interval`` seconds while the block runs (and once before and after it).

    Example:
        >>> with sample_rss() as rss:
        ...     model(**inputs)
        >>> (rss.peak_bytes - rss.start_bytes) / 2**20   # MiB the block added at most
    """
    if not interval > 0:
        raise ValueError(f"interval must be > 0 seconds, got {interval!r}")
    samples = RSSSamples()
    stop = threading.Event()
    t0 = time.perf_counter()

    def take() -> None:
        samples.times.append(time.perf_counter() - t0)
        samples.bytes.append(rss_bytes())

    def loop() -> None:
        while not stop.wait(interval):
            take()

    take()
    thread = threading.Thread(target=loop, name="memkit-rss", daemon=True)
    thread.start()
    try:
        yield samples
    finally:
        stop.set()
        thread.join()
        take()
