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
    "unsharded_parameter",
    "buffer",
    "gradient",
    "optimizer_state",
    "ema",
    "collective",
    "activation",
    "temporary",
    "input",
    "unknown",  # last: codes are positions, and saved snapshots and plot colours rely on them
)
"""Memory categories, in stacking order (bottom first).

A storage has one category for its whole life: its final role. When the role becomes known after the
allocation (autograd stores it in ``param.grad``, it survives in ``optimizer.state``, backward starts while it
is alive), the allocation event is rewritten, so a stacked timeline never jumps from one category to another;
a storage that dies before its role is known keeps the category it was born with. The phase column is
separate: it says what was running at each event (forward, backward, optimizer, ema, other).

================ ======================================================== =========================================
category         memkit (the tracker's rule)                              torch's ``MemTracker`` (nearest; difference)
================ ======================================================== =========================================
parameter        the parameters of the model given to ``track()`` and of  ``Parameter``: the same bytes.
                 every module its forward hooks see; under FSDP2 the
                 local shards of its DTensor parameters
unsharded_parameter
                 FSDP2: the full parameters all-gathered (or copied, at   ``FSDPMemTracker``'s ``UNSHARDED_PARAM``:
                 world size 1) into the storages FSDP resizes from 0      the same bytes.
                 bytes before a block's forward or backward and back
                 to 0 after (see ``memory/fsdp.py``)
buffer           those modules' buffers                                   ``Buffer``: the same bytes.
gradient         a storage that ends in ``param.grad``, from its          ``Gradient``: the same storages, but moved
                 allocation (an out-of-place accumulation's result        from ``Temp`` only when the parameter's
                 too); an incoming gradient added in place into           grad hook runs. At the end of backward the
                 ``param.grad`` dies before it has a role: temporary      two agree to the byte.
optimizer_state  what survives in ``optimizer.state`` after the step     ``Optstate``: also every storage allocated
                 (Adam's ``exp_avg``/``exp_avg_sq``/``step``, SGD's       inside ``optimizer.step()``, the update's
                 ``momentum_buffer``), from its allocation                scratch included. After the step the two
                                                                          agree to the byte; during it, ``Optstate``
                                                                          = optimizer_state + the temporaries
                                                                          allocated in the step (kernel-internal
                                                                          buffers aside: MemTracker cannot see them).
ema              what ``memkit.memory.tag(..., "ema")`` names (EMA        none: ``Other`` if passed to
                 shadows), or ``owned`` gives as "ema"                    ``track_external``, else ``Activation``
                                                                          (or ``Optstate`` inside the step).
collective       FSDP2: the buffers it allocates to communicate (all-     ``FSDPMemTracker``'s ``ALL_GATHER`` +
                 gather output, reduce-scatter input), alive while in     ``REDUCE_SCATTER`` at world size > 1; at
                 flight; its reduce-scatter output becomes the gradient   1 FSDP issues no collective and
                 shards, so it is ``gradient``                            ``FSDPMemTracker`` counts them ``TEMP``.
activation       allocated in the forward phase (inside a module's        ``Activation``: everything allocated
                 forward, or under ``memory.phase("forward")``, as        outside backward and outside the
                 memkit's step computes its loss) and still alive when    optimizer step, including forward scratch
                 backward starts; and everything recomputed inside        that dies before backward and allocations
                 backward by activation checkpointing                     between the phases (the backward's seed
                                                                          gradient). At the start of backward the
                                                                          two agree to the byte when everything
                                                                          before it ran in a module or the forward
                                                                          phase (as in memkit's step).
temporary        everything else allocated in the window: scratch that    ``Temp``: only what backward allocates
                 dies within its phase (forward scratch, the optimizer's  (outside recomputation), gradients until
                 ``sqrt``/``div`` outputs, a backward's gradients of      their hook runs.
                 activations), an output nobody keeps, every
                 allocation of a forward with no backward (inference),
                 and the buffers kernels allocate internally
input            the ``inputs`` given to ``track()``                      ``Other``: tensors passed to
                                                                          ``track_external``.
unknown          never from the tracker: what a CUDA snapshot read by     none.
                 :meth:`Timeline.from_snapshot` holds (it carries no
                 categories, and none is guessed)
================ ======================================================== =========================================

So the optimizer's scratch is the peak of ``temporary`` during the optimizer phase, and the memory a step
keeps for backward is ``activation`` at the start of backward. ``tests/test_categories.py`` checks each rule,
and checks the relations with ``MemTracker`` on four presets.
"""

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
