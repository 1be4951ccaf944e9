"""The event schema shared by every memkit tracker (CPU, CUDA, fake tensors) and snapshot importer.

One event is one storage allocation or free. Events are stored as numpy columns (see :class:`Timeline`);
while tracking they are appended to an :class:`EventLog`, whose rows are plain tuples so that the hot path
costs one ``list.append``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TypeVar

import numpy as np

CATEGORIES: tuple[str, ...] = (
    "parameter",
    "buffer",
    "gradient",
    "optimizer_state",
    "ema",
    "activation",
    "temporary",
    "input",
    "unknown",  # last: codes are positions, and saved snapshots and plot colours rely on them
)
"""Memory categories, in stacking order (bottom first)."""

PHASES: tuple[str, ...] = ("forward", "backward", "optimizer", "ema", "other")
"""Phases of a training step."""

ALLOC, FREE = 0, 1
ACTIONS: tuple[str, ...] = ("alloc", "free")

CATEGORY_CODE = {name: i for i, name in enumerate(CATEGORIES)}
PHASE_CODE = {name: i for i, name in enumerate(PHASES)}

COLUMNS: tuple[tuple[str, type], ...] = (
    ("time", np.float64),  # seconds since tracking began
    ("action", np.int8),  # ALLOC or FREE
    ("bytes", np.int64),  # always positive
    ("category", np.int8),  # index into CATEGORIES
    ("phase", np.int8),  # index into PHASES
    ("device", np.int16),  # index into EventLog.devices
    ("op", np.int32),  # index into EventLog.ops (the aten op that allocated), -1 if unknown
    ("frame", np.int32),  # index into EventLog.frames (interned python stack), -1 if not recorded
    ("storage", np.int64),  # storage key pairing an alloc with its free
)


CUDA_BLOCK = 512
"""The CUDA caching allocator's smallest block, in bytes: every allocation is rounded up to a multiple of it."""

_Bytes = TypeVar("_Bytes", int, np.ndarray)


def round_alloc(nbytes: _Bytes, granularity: int | None) -> _Bytes:
    """``nbytes`` (an int or an int array) rounded up like the caching allocator: to a multiple of
    ``granularity``, at least one granularity (so 0 bytes take a block). ``None`` or 0: unchanged.

    Example:
        >>> round_alloc(1000, CUDA_BLOCK), round_alloc(1000, None)
        (1024, 1000)
    """
    if not granularity:
        return nbytes
    rounded = -(-nbytes // granularity) * granularity
    return np.maximum(rounded, granularity) if isinstance(rounded, np.ndarray) else max(rounded, granularity)


def check_category(category: str) -> int:
    """Return the code of ``category``, or raise a ValueError that lists the allowed names."""
    try:
        return CATEGORY_CODE[category]
    except KeyError:
        raise ValueError(f"category must be one of {list(CATEGORIES)}, got {category!r}") from None


class _Interner:
    """Maps strings to small integers, in first-seen order."""

    def __init__(self, items: list[str] | None = None):
        self.items: list[str] = []
        self._index: dict[str, int] = {}
        for item in items or ():
            self(item)

    def __call__(self, item: str) -> int:
        code = self._index.get(item)
        if code is None:
            code = self._index[item] = len(self.items)
            self.items.append(item)
        return code


@dataclass
class EventLog:
    """Append-only rows of events, plus the retags applied to earlier allocations.

    A retag rewrites the category of an allocation event after the fact, because some categories are only
    known once the storage's role is known (a gradient is the storage autograd stores in ``param.grad``;
    optimizer state is what survives in ``optimizer.state``). The tracker writes each free with the
    storage's category at that time, so after the retags a storage has one category for its whole life.
    """

    rows: list[tuple] = field(default_factory=list)
    retags: list[tuple[int, int]] = field(default_factory=list)  # (event index, new category code)
    devices: _Interner = field(default_factory=_Interner)
    ops: _Interner = field(default_factory=_Interner)
    frames: _Interner = field(default_factory=_Interner)

    def columns(self) -> dict[str, np.ndarray]:
        """Materialize the rows as numpy columns, with every retag applied."""
        n = len(self.rows)
        if n:
            cols = list(zip(*self.rows, strict=True))
            out = {name: np.asarray(cols[i], dtype=dt) for i, (name, dt) in enumerate(COLUMNS)}
        else:
            out = {name: np.zeros(0, dtype=dt) for name, dt in COLUMNS}
        if self.retags:
            cat = out["category"]
            for index, code in self.retags:
                cat[index] = code
        return out
