"""Oracles the tests share: what torch itself measured, to check memkit's numbers against.

``profiler_window`` reads the CPU allocator's bytes from ``torch.profiler`` (independent of memkit's tracker);
``tracked_and_profiled`` runs a function under both; ``assert_equals_profiler`` says they agree to the byte.
Test modules import them as ``from oracles import ...`` (pytest puts ``tests/`` on the path).

Example:
    >>> tl, (peak, end) = tracked_and_profiled(lambda: torch.ones(256).sum())
    >>> assert_equals_profiler(tl, peak, end)
"""

from .profiler import assert_equals_profiler, profiler_window, tracked_and_profiled

__all__ = ["assert_equals_profiler", "profiler_window", "tracked_and_profiled"]
