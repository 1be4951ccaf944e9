"""Watch a running step from the inside: stop it between two ops, and hand out its live timeline in batches.

A ``TorchDispatchMode`` entered around ``compare``/``estimate`` sees every op of every step they run, forward
and backward alike. Before each aten op it asks ``should_stop()`` and, when told to, raises :class:`Stopped`, which
unwinds through the library's own ``with`` blocks (handles removed, tracker stopped), so the next run starts
clean. After an op it hands the timeline of the tracked step that is running (if any) to ``on_update``, at
most once per ``interval`` seconds (longer when drawing takes longer), plus once more when that tracked step
ends: a batch of events per call, never one call per event. Entered before the library's tracker, it sits
below it on the mode stack, so the tracker is switched off while its callbacks run: their work is not recorded.

Costs a few microseconds per op (one Python call); nothing on the numbers (ops run unchanged).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from torch.utils._python_dispatch import TorchDispatchMode

from ..memory import current_timeline
from ..memory.timeline import Timeline

__all__ = ["Stopped", "watching"]


class Stopped(Exception):
    """A stop was asked for: the run ended between two ops."""


class _Watch(TorchDispatchMode):
    def __init__(
        self,
        should_stop: Callable[[], bool] | None,
        on_update: Callable[[Timeline], Any] | None,
        interval: float,
    ) -> None:
        super().__init__()
        self.should_stop, self.on_update, self.interval = should_stop, on_update, interval
        self.current: Timeline | None = None  # the tracked step being followed
        self.next = float("-inf")  # perf_counter time of the next update
        self.updates = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        # Only around real ops: metadata queries (prim.device) are also called from C++ that cannot unwind, where
        # an exception aborts the process (seen under FakeTensorMode).
        aten = func.namespace == "aten"
        if aten and self.should_stop is not None and self.should_stop():
            raise Stopped("stopped on request")
        out = func(*args, **(kwargs or {}))
        if aten and self.on_update is not None:
            self.follow()
        return out

    def follow(self) -> None:
        tl = current_timeline()  # compare() and estimate() open their trackers inside
        if tl is not self.current:
            self.flush()  # the step followed so far has ended: its final state, once
            self.current = tl
        if tl is not None and time.perf_counter() >= self.next:
            self.update(tl)

    def update(self, tl: Timeline) -> None:
        start = time.perf_counter()
        self.updates += 1
        self.on_update(tl)
        # Reading a timeline copies its events: on a long step that grows, so the wait grows with it and the
        # live view never takes more than a fifth of the run.
        self.next = start + max(self.interval, 5 * (time.perf_counter() - start))

    def flush(self) -> None:
        tl, self.current = self.current, None
        if tl is not None and self.on_update is not None:
            self.update(tl)


@contextmanager
def watching(
    *,
    should_stop: Callable[[], bool] | None = None,
    on_update: Callable[[Timeline], Any] | None = None,
    interval: float = 0.5,
) -> Iterator[_Watch]:
    """Inside the block, every op first checks ``should_stop()`` (:class:`Stopped` when it says so), and the
    running tracked step's timeline goes to ``on_update`` at most every ``interval`` seconds and when it ends.

    Example:
        >>> with watching(should_stop=event.is_set, on_update=draw):
        ...     memkit.compare("flux", {"ckpt": [memkit.Checkpointing()]})
    """
    if not interval > 0:
        raise ValueError(f"interval must be > 0 seconds, got {interval!r}")
    watch = _Watch(should_stop, on_update, interval)
    with watch:
        yield watch
    watch.flush()  # the last tracked step had no op after it
