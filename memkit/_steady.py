"""The steady step's forward and backward derived from the first step's, in a memoized estimate.

A training step is a forward and a backward that make the gradients, then the optimizer's update. Between the first
step and the second only the optimizer's state differs: it is made in the first update and carried by every later
step. The forward and backward of the second step therefore allocate and free what the first step's did, in the same
order and sizes, on other storages (its gradients are the ones the second update reads). So the probe of a memoized
estimate runs the forward and backward once:

- step 1 runs whole, and :class:`Derived` notes where its backward ended and each gradient it left (parameter,
  storage, shape, the block the tagger gave it);
- step 2 makes each gradient again, empty, with the first one's shape, then runs the update alone
  (:func:`memkit.step.update`: the optimizer's step, ``zero_grad``, the handle's ``after_step``);
- :meth:`Derived.rewrite` replaces the events of those empty gradients by the first step's forward and backward
  events, on fresh storage keys, their gradients on the keys the update read; what the first step freed at its very
  end (the loss) is freed at the steady step's end. A parameter whose storage the forward replaces (diffusers'
  layerwise casting, ``Quantize("fp8-storage")``: cast up before each module, stored again in fp8 after it) frees,
  in the steady step, the storage the first step left it, and its new storage is the copy's from then on.

The probe's own two-step run is the check: ``estimate(..., memoize=False)`` runs both steps whole, and the spliced
timeline is byte-equal to it on every preset and memoized setting (``tests/test_memo.py``). The derivation is used
only where it holds by construction: a plain optimizer (no fused backward, no gradient scaler, on the device, no
FSDP), gradients that start each step as None, nothing freed in the forward and backward that the step did not make
(but a replaced parameter's storage, once); where the estimate counts the steady step's ops (``count_ops``), the
first step's forward and backward are counted with the steady update. Elsewhere the second step runs whole.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch

from . import _counted
from ._memo_tagger import OwnedNow
from .memory._fake_dispatch import extent
from .memory.events import ALLOC, FREE
from .step import update

ENABLED = True
"""False runs the probe's steady step whole, as before this module (``bench/estimate_speed.py`` times both)."""

_FRESH = 1 << 61  # synthetic storage keys: above any address a storage has, never -1 (a kernel's own buffer)


class Derived:
    """Run a memoized probe's two tracked steps, deriving the second's forward and backward from the first's (see
    the module docstring). ``eligible`` says whether the settings allow it; ``derived`` whether it was done."""

    def __init__(self, tracker, tagger, runner, *, parallel: Any) -> None:
        step = runner.step
        self.tracker, self.tagger, self.runner = tracker, tagger, runner
        self.eligible = (
            ENABLED
            and tagger is not None
            and parallel is None
            and step.first_and_steady
            and runner.optimizer is not None
            and not runner.fused
            and runner.scaler is None
            and getattr(step, "optimizer_on", "device") == "device"
            and not hasattr(runner.optimizer, "host_tensors")
        )
        self.derived = False
        self.counter = None  # the estimate's op counter over both steps (count_ops), set by memkit._counted
        self._counted: tuple[Counter, Counter] | None = None  # its counts when step 1's backward ended
        self._first: tuple[int, int] | None = None  # (step 1's first row, the row after its backward)
        self._grads: list[tuple[torch.nn.Parameter, int, tuple, tuple, torch.dtype, torch.device, Any]] = []
        self._marks: tuple[int, int, int] | None = None
        self._storages: dict[torch.nn.Parameter, int] = {}
        self._ended: dict[torch.nn.Parameter, int] = {}
        self._moved: dict[int, int] = {}  # a parameter's storage before step 1 -> its storage after the backward
        self._left = 0  # what step 1's forward and backward left that step 1 frees at its end (the loss)
        # set by _steady: the keys of the empty gradients, the rows around them, the op and stack tables' sizes
        self._made: list[int] = []
        self._interned: list[tuple[int, int]] = []
        self._end_phase: int | None = None  # the tracker's phase when the steady update's last op ran

    # ---- running --------------------------------------------------------------------------------------------
    def run_steps(self, inputs, n: int, tracked: int, starts: list[int], bar, host: dict, label: str, count_ops: bool):
        """Run an estimate's ``tracked`` last steps of ``n`` (appending where each starts to ``starts``, advancing
        ``bar``); returns the steady step's op counts as a list of one :class:`memkit.steptime.OpCounts` where
        ``count_ops`` (over both steps where the steady one is derived: :mod:`memkit._counted`), else empty."""
        tracker, tagger, runner = self.tracker, self.tagger, self.runner
        counted: list = []
        both = count_ops and tracked == 2 and self.eligible
        with _counted.counting_step(tracker, tagger, runner, host, label, both, self) as counted_both:
            for i in range(n - tracked, n):
                bar.set_postfix_str(f"step {i + 1}/{n} (tracked)")
                starts.append(len(tracker.log.rows))
                once = count_ops and not both and i == n - 1
                with _counted.counting_step(tracker, tagger, runner, host, label, once) as c:
                    if tracked == 2:
                        self.run(i - (n - tracked), inputs)
                    else:
                        runner.run(inputs)
                counted += c
                bar.update()
        return counted + counted_both

    def run(self, index: int, inputs) -> None:
        """Run tracked step ``index`` (0: the first, 1: the steady one)."""
        if not self.eligible:
            self.runner.run(inputs)
        elif index == 0:
            start = len(self.tracker.log.rows)
            self._storages = _parameter_storages(self.runner.model)
            self.runner.run(inputs, on_grads=self._backward_done)
            if self._first is not None:
                self._first = (start, self._first[1])
        elif not self._can_derive():
            self._keep_counts(None)  # the steady step is counted whole
            self.runner.run(inputs)
        else:
            self._keep_counts(self._counted)  # the first step's forward and backward, then the steady update
            self._steady()

    def _keep_counts(self, counts: tuple[Counter, Counter] | None) -> None:
        if self.counter is not None:
            ops, tagged = counts if counts is not None else (Counter(), Counter())
            self.counter.ops, self.counter.tagged = Counter(ops), Counter(tagged)
            self.counter.owned = OwnedNow(self.tagger._owned_refs(self.runner.optimizer))  # the state step 1 made

    def _backward_done(self, model: torch.nn.Module) -> None:
        rows = len(self.tracker.log.rows)
        if self.counter is not None:
            self._counted = (Counter(self.counter.ops), Counter(self.counter.tagged))
        grads, seen = [], set()
        for p in model.parameters():
            g = p.grad
            if g is None:
                continue
            s = g.untyped_storage()
            key = s._cdata
            if (
                type(g) is not torch.Tensor
                and not isinstance(g, torch._subclasses.FakeTensor)
                or key in seen
                or g.storage_offset() != 0
                or s.nbytes() != extent(g.shape, g.stride()) * g.element_size()
            ):
                return  # a gradient that is a view, shares storage or is a subclass: the second step runs whole
            seen.add(key)
            grads.append((p, key, tuple(g.shape), tuple(g.stride()), g.dtype, g.device, self.tagger.owner.get(key)))
        self._grads = grads
        self._ended = _parameter_storages(model)  # a replaced parameter's storage (see _can_derive)
        self._first = (-1, rows)

    def _can_derive(self) -> bool:
        if self._first is None or not self._grads:
            return False
        start, end = self._first
        rows = self.tracker.log.rows
        live: dict[int, int] = {}
        # a parameter's storage from before the step, freed in it: the parameter was given a new one (diffusers'
        # layerwise casting: module.to() before each forward, the storage dtype's copy made again after it), which
        # the steady step frees instead (keys are addresses: the new storage may have the old one's)
        owner_of = {key: p for p, key in self._storages.items()}
        if len(owner_of) != len(self._storages):
            return False  # parameters sharing a storage
        freed: set[int] = set()
        for i in range(start, end):
            row = rows[i]
            key = row[8]
            if key == -1:
                continue
            if row[1] == ALLOC:
                live[key] = i
            elif key in live:
                del live[key]
            elif key in owner_of and key not in freed:
                freed.add(key)
            else:
                return False  # the forward or backward freed a storage from before the step, not a parameter's
        grads = {key for _, key, *_ in self._grads}
        if not grads <= live.keys():
            return False  # a gradient the backward did not make
        self._moved = {key: self._ended.get(owner_of[key]) for key in freed}
        successors = set(self._moved.values())
        if not successors <= live.keys() or len(successors) != len(freed):
            return False  # a replaced parameter whose new storage the step did not make, or shares
        # what else the forward and backward left (the loss) must be freed at the very end of step 1
        left = [key for key in live if key not in grads and key not in successors]
        tail = rows[len(rows) - len(left) :] if left else []
        if sorted(r[8] for r in tail) != sorted(left) or any(r[1] != FREE for r in tail):
            return False
        self._left = len(left)
        return True

    def _steady(self) -> None:
        log = self.tracker.log
        rows = log.rows
        m0 = len(rows)
        interned = (len(log.ops.items), len(log.frames.items))
        made = []
        for p, _, shape, stride, dtype, device, owner in self._grads:
            p.grad = torch.empty_strided(shape, stride, dtype=dtype, device=device)
            self.tracker.register([p.grad], "gradient")  # as the backward's hook on each gradient does
            key = p.grad.untyped_storage()._cdata
            self.tagger.owner[key] = owner
            made.append(key)
        m1 = len(rows)
        # an op (or stack) first seen making the empty gradients is no op of the real step: dropped with them
        self._interned = [(a, b) for a, b in zip(interned, (len(log.ops.items), len(log.frames.items)), strict=True)]
        ops = self.tagger.epoch
        update(self.runner.optimizer, self.runner.handle, self.runner.scaler)
        # what step 1 freed at its end is freed in the phase of the op before (an EMA that updates every other step
        # ends the steady step in its own phase, and step 1 in the optimizer's)
        self._end_phase = self.tracker._last_phase if self.tagger.epoch > ops else None
        self._made = made
        self._marks = (m0, m1, len(rows))
        self.derived = True

    # ---- rewriting ------------------------------------------------------------------------------------------
    def rewrite(self) -> None:
        """Put the derived forward and backward into the tracker's log and the tagger's tags (after tracking)."""
        if not self.derived:
            return
        log, tagger = self.tracker.log, self.tagger
        rows = list(log.rows)
        for index, code in log.retags:  # one category per storage from here on: the copies keep their original's
            r = rows[index]
            rows[index] = (*r[:3], code, *r[4:])
        log.retags.clear()
        start, end = self._first
        m0, m1, m_end = self._marks
        grad_of = {g[1]: new for g, new in zip(self._grads, self._made, strict=True)}
        moved = self._moved
        ended = grad_of.keys() | moved.values()
        final = {}  # a gradient's (a replaced parameter's) key -> the row that made its storage at the backward's end
        for i in range(start, end):
            if rows[i][8] in ended and rows[i][1] == ALLOC:
                final[rows[i][8]] = i
        fresh = _FRESH
        mapped: dict[int, int] = {}
        copies, tags, epochs = [], [], []
        base = tagger.epochs[m0 - 1] + 1 if m0 else 0
        for i in range(start, end):
            r = rows[i]
            key = r[8]
            if key != -1:
                if r[1] == ALLOC:
                    if key in grad_of and final.get(key) == i:
                        new = grad_of[key]
                    else:
                        fresh += 1
                        new = fresh
                    mapped[key] = new
                elif key in mapped:
                    new = mapped.pop(key)
                else:  # a parameter's storage from before the step: the steady step frees the first step's copy,
                    new = moved[key]  # under the category the tracker gave that copy
                    r = (*r[:3], rows[final[new]][3], *r[4:])
                r = (*r[:8], new)
            copies.append(r)
            tags.append(tagger.tags[i])
            epochs.append(tagger.epochs[i] - tagger.epochs[start] + base)
        # the update's events follow, their epochs after the copies'; then what step 1 freed at its end
        after = (epochs[-1] + 1 if epochs else base) - (tagger.epochs[m1] if m1 < len(tagger.epochs) else 0)
        later = [e + after for e in tagger.epochs[m1:]]
        n = self._left
        ends = [(*r[:8], mapped[r[8]]) for r in rows[m0 - n : m0]]
        if self._end_phase is not None:
            ends = [(*r[:4], self._end_phase, *r[5:]) for r in ends]
        end_epoch = later[m_end - m1 - 1] if m_end > m1 else (epochs[-1] if epochs else base)
        # a replaced parameter's storage is, from the steady step on, its copy's (the step's own events name it so)
        renamed = {successor: mapped[successor] for successor in moved.values()}
        update = [(*r[:8], renamed[r[8]]) if r[8] in renamed else r for r in rows[m1:]]
        new_rows = rows[:m0] + copies + update[: m_end - m1] + ends + update[m_end - m1 :]
        new_tags = tagger.tags[:m0] + tags + tagger.tags[m1:m_end] + tagger.tags[m0 - n : m0] + tagger.tags[m_end:]
        new_epochs = tagger.epochs[:m0] + epochs + later[: m_end - m1] + [end_epoch] * n + later[m_end - m1 :]
        for column, interner, (lo, hi) in zip((6, 7), (log.ops, log.frames), self._interned, strict=True):
            if hi > lo:
                new_rows = [(*r[:column], r[column] - (hi - lo), *r[column + 1 :]) if r[column] >= hi else r
                            for r in new_rows]  # fmt: skip
                if any(lo <= r[column] < hi for r in new_rows):
                    raise AssertionError("an op first seen making the empty gradients is used by another event")
                del interner.items[lo:hi]
                interner._index = {item: i for i, item in enumerate(interner.items)}
        list.__init__(log.rows, new_rows)  # the tagger's row list keeps its type (it tags rows appended later)
        tagger.tags[:] = new_tags
        tagger.epochs[:] = new_epochs


def _parameter_storages(model: torch.nn.Module) -> dict[torch.nn.Parameter, int]:
    return {p: p.untyped_storage()._cdata for p in model.parameters()}
