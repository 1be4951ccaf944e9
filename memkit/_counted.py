"""The op counts of an estimate's own steady step (``memkit.estimate(..., count_ops=True)``): the step
:mod:`memkit.steptime` times, counted while the estimate tracks it instead of in runs of its own.

The counter (:class:`memkit.steptime._Counter`, the one :func:`memkit.steptime.count_ops` uses) sits inside the
tracker's dispatch: each op reaches it first, runs through the tracker (which records it, and the probe's
:class:`memkit._memo_tagger.Tagger` tags it), and is counted with the block the tagger says it belongs to, by the
rule the splice follows for the op's output: inside a block's forward (recompute included), that block; in the
backward, the block whose forward made the running autograd node; between blocks in the forward, the block before;
elsewhere (the optimizer, ``zero_grad``), the block owning what it reads (a ``_foreach`` op per tensor: the block of
its i-th tensor; an EMA's lerp into its one buffer of every block's shadows: the block of the shadow it writes). A
memoized estimate runs a probe of four blocks per list, the third standing for every block but the first two and the
last, so an op of that block counts ``n - 3`` times in a list of ``n`` blocks, every other op once (with a
checkpointing period, each block of the period the forward repeats counts for the blocks of its phase,
:func:`memkit._memo.stands_for`): the full model's counts, equal to :func:`memkit.steptime.count_ops` running every
block (``tests/test_counted.py``).
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator

import torch

from ._memo import _AGG, Unsupported, stands_for
from ._memo_tagger import OwnedNow
from .memory.events import ALLOC, PHASE_CODE
from .steptime import Op, OpCounts, _Counter, _disk_loads

_EMA = PHASE_CODE["ema"]


class _TaggedCounter(_Counter):
    """A :class:`_Counter` that counts each op under the block the probe's tagger gives it."""

    def __init__(self, host, disk, tracker, tagger, optimizer):
        super().__init__(host, disk, fake=False)  # the tracker computes the outputs: the counter only looks
        self.tracker = tracker
        self.tagger = tagger
        self.tagged: Counter = Counter()
        # every block's parameters, gradients and optimizer state by storage (the step counts too, which the tracker
        # may not hold: a host scalar)
        self.owned = OwnedNow(tagger._owned_refs(optimizer) if tagger is not None else {})

    def _add(self, op: Op, out: torch.Tensor) -> None:
        if self.tagger is None:
            self.ops[op] += 1
            return
        key = out.untyped_storage()._cdata
        tag = self.tagger._context((0, ALLOC, 0, 0, self.tracker._last_phase, 0, 0, 0, key))
        if tag is None or tag is _AGG:
            # an op over tensors of several blocks (a _foreach op, counted per tensor), or over tensors the tracker
            # does not hold (the optimizer's step counts): the block of the tensor it makes or writes, if any
            tag = self.tagger.owner.get(key) or self.owned.get(key)
            if tag is None and key in self.tagger.shadows:  # an EMA's buffer of every block's shadows
                tag = self.tagger.shadow_block(out)
            elif tag is None and self.tracker._explicit and self.tracker._explicit[-1] == _EMA:
                # an EMA update's op that writes no shadow (a staging buffer): not each one block's
                raise Unsupported("an EMA's update writes a storage of no block: its ops are not counted per block")
        self.tagged[op, tag] += 1

    def counts(self) -> Counter:
        """The full model's counts: each probe block's ops times the blocks it stands for."""
        total = Counter(self.ops)
        if self.tagger is not None:
            lists, period = self.tagger.lists, self.tagger.period
            for (op, tag), n in self.tagged.items():
                if isinstance(tag, tuple) and len(tag) == 2:  # a probe block's: times the blocks it stands for
                    _, full, blocks = lists[tag[0]]
                    n *= stands_for(tag[1], full, len(blocks), period)
                total[op] += n
        return total


@contextlib.contextmanager
def counting_step(
    tracker, tagger, runner, host: dict, label: str, count: bool, derived=None
) -> Iterator[list[OpCounts]]:
    """Count the ops of the code inside the block (one step the estimate tracks, ``runner`` its bound step, ``host``
    the placement plan's host tensors) where ``count``: yields a list that holds the :class:`OpCounts` once the block
    ends (empty where not ``count``). With ``derived`` (a :class:`memkit._steady.Derived`), the block is both tracked
    steps, and ``derived`` keeps of the count what the steady step does: the first step's forward and backward, then
    the steady update (or the whole steady step, where it runs whole)."""
    out: list[OpCounts] = []
    if not count:
        yield out
        return
    disk: list[int] = []
    noted = [t for ts in host.values() for t in ts]
    counter = _TaggedCounter(noted, disk, tracker, tagger, runner.optimizer)
    if derived is not None:
        derived.counter = counter
    with _disk_loads(disk), counter.hooks():
        yield out
    sizes = "/".join(str(s) for s in sorted({len(b) for _, _, b in tagger.lists})) if tagger is not None else ""
    memo = "counted as the estimate ran" + (f", {sizes} blocks per list weighted" if tagger is not None else "")
    out.append(OpCounts(Counter({k: v for k, v in counter.counts().items() if v}), dict(label=label, memo=memo)))
