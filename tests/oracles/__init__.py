"""Oracles the tests share: what torch itself measured, to check memkit's numbers against.

``real_steps`` runs a real CPU training loop tracked step by step (``Wide``: a net whose steady step peaks above its
first); ``profiler_window`` reads the CPU allocator's bytes from ``torch.profiler`` (independent of memkit's tracker);
``tracked_and_profiled`` runs a function under both; ``assert_equals_profiler`` says they agree to the byte.
Test modules import them as ``from oracles import ...`` (pytest puts ``tests/`` on the path).

Example:
    >>> tl, (peak, end) = tracked_and_profiled(lambda: torch.ones(256).sum())
    >>> assert_equals_profiler(tl, peak, end)
"""

from .profiler import assert_equals_profiler, profiler_window, tracked_and_profiled
from .steps import Wide, real_steps, tracked_steps, wide_inputs

__all__ = [
    "Wide",
    "assert_equals_profiler",
    "profiler_window",
    "real_steps",
    "tracked_and_profiled",
    "tracked_steps",
    "wide_inputs",
]
