"""The splice of block memoization: the full model's events from a probe's tagged events (see :mod:`memkit._memo`).

The probe's tagged events fall into *sweeps*: runs of consecutive events that go through the blocks of one list in
order (the forward, the backward in reverse, each ``_foreach`` op of the optimizer, ``zero_grad``). The full
timeline is the probe's with each sweep's third block (going down: second) repeated for every middle block of the
full model (with a checkpointing period of N blocks, a period of N probe blocks in the full model's phase), with fresh
storage keys: a free is resolved to the allocation it pairs with in the full model (in the
same block, or the one at the same distance), matching two probe blocks' events as sequences where they differ
(the first and last block do a little more or less than a middle one). Whatever does not fit raises
:class:`~memkit._memo.Unsupported`, and the estimate runs every block instead.
"""

from __future__ import annotations

import difflib
from typing import Any

import numpy as np

from ._memo import _AGG, Unsupported, head, own
from ._memo_tagger import Tagger
from .memory.events import ALLOC, CATEGORIES, COLUMNS, PHASE_CODE

_OTHER = PHASE_CODE["other"]


def splice(tagger: Tagger, rows: list[tuple], retags: list[tuple[int, int]], baseline: dict[str, int]):
    """The full model's events and baseline from the probe's: returns (rows, baseline, source) where
    ``source[i]`` is the probe row the full row ``i`` repeats. Raises :class:`Unsupported` where the probe's
    events do not split into sweeps of its blocks."""

    if len(tagger.tags) != len(rows):
        raise Unsupported("events were appended to the probe's log without a tag")
    tags = _filled(tagger.tags, [r[4] for r in rows])
    full = [n for _, n, _ in tagger.lists]
    sizes = [len(blocks) for _, _, blocks in tagger.lists]  # the probe's blocks per list
    period = tagger.period
    category = [r[3] for r in rows]
    for index, code in retags:
        category[index] = code

    # each free's allocation: a probe row, or a baseline storage
    alloc_of: dict[int, int] = {}
    pair: list[Any] = [None] * len(rows)
    for i, row in enumerate(rows):
        key = row[8]
        if row[1] == ALLOC:
            alloc_of[key] = i
        elif key == -1:
            pair[i] = i - 1  # a kernel's internal buffer: freed right after it is allocated
        else:
            j = alloc_of.pop(key, None)
            pair[i] = j if j is not None else ("base", key)

    # sweeps: maximal runs of events of one list, going through its blocks in order
    sweeps: list[_Sweep] = []
    sweep_of = [-1] * len(rows)
    pos_of = [-1] * len(rows)
    epochs = tagger.epochs
    i = 0
    while i < len(rows):
        tag = tags[i]
        if tag is _AGG:
            raise Unsupported(f"event {i} reads storages of several blocks at once")
        if tag is None:
            i += 1
            continue
        li, phase = tag[0], rows[i][4]
        runs: list[list[int]] = [[] for _ in range(sizes[li])]
        order: list[int] = []
        j = i
        while j < len(rows) and tags[j] is not None and tags[j] is not _AGG and tags[j][0] == li:
            if rows[j][4] != _OTHER:  # FSDP's hooks gather and free between a block's forward events
                if phase == _OTHER:
                    phase = rows[j][4]
                elif rows[j][4] != phase:
                    break
            b = tags[j][1]
            if order and order[-1] != b and b in order:  # the next sweep begins
                last = runs[order[-1]]
                if len(order) >= 2 and (order[-2] < order[-1]) == (b < order[-1]):
                    # up and down again (a _foreach op's outputs, then their frees in reverse): the last block's
                    # events split where the op that freed them began
                    cut = [k for k in range(1, len(last)) if epochs[last[k]] != epochs[last[k - 1]]]
                    if not cut:
                        raise Unsupported(f"events {i}-{j} turn back in block {order[-1]}")
                    j = last[cut[-1]]
                    del last[cut[-1] :]
                break
            if not order or order[-1] != b:
                order.append(b)
            sweep_of[j] = len(sweeps)
            pos_of[j] = len(runs[b])
            runs[b].append(j)
            j += 1
        order = [b for b in order if runs[b]]
        up = list(range(sizes[li]))
        if len(order) == 1 and order[0] not in (0, sizes[li] - 1):
            raise Unsupported(f"events {i}-{j} belong to block {order[0]} of {tagger.lists[li][0]!r} alone")
        if len(order) > 1 and order not in (up, up[::-1]):
            raise Unsupported(f"events {i}-{j} go through blocks {order} of list {tagger.lists[li][0]!r}")
        sweeps.append(_Sweep(li, i, runs, order, full[li], period))
        i = j

    # baseline storages of each probe block, in registration order, and what the repeated ones add
    base_of: dict[tuple[int, int], list[int]] = {}
    for key, owner in tagger.base_owner.items():
        base_of.setdefault(owner, []).append(key)
    base_pos = {key: q for keys in base_of.values() for q, key in enumerate(keys)}
    out_baseline = dict(baseline)
    for li, n in enumerate(full):
        shapes = [
            [(tagger.base[k].nbytes, tagger.base[k].category) for k in base_of.get((li, b), [])]
            for b in range(sizes[li])
        ]
        if any(shape != shapes[1] for shape in shapes[2:-1]):
            raise Unsupported(f"the middle blocks of {tagger.lists[li][0]!r} hold different state before the step")
        for nbytes, code in shapes[1]:
            out_baseline[CATEGORIES[code]] += (n - sizes[li]) * nbytes
    for key, nbytes in _grown(tagger).items():  # an EMA's one buffer of every block's shadows
        out_baseline[CATEGORIES[tagger.base[key].category]] += nbytes - tagger.base[key].nbytes

    def token(r: int) -> tuple:
        row = rows[r]
        return (row[1], row[2], category[r], row[4], row[6])

    aligned: dict[tuple, dict[int, int]] = {}

    def same_event(runs: list[list[int]], b: int, b2: int, p: int) -> int | None:
        """The position in block b2's events of a sweep of the event at position p of block b's, matching the
        two blocks' events as sequences (the first and last block may do a little more or less than a middle
        one: the first gradient of an input every block uses is kept, the later ones added)."""
        if b == b2:
            return p
        x, y = runs[b], runs[b2]
        key = (x[0], y[0])
        if key not in aligned:
            matcher = difflib.SequenceMatcher(None, [token(r) for r in x], [token(r) for r in y], autojunk=False)
            aligned[key] = {u + k: v + k for u, v, n in matcher.get_matching_blocks() for k in range(n)}
        return aligned[key].get(p)

    counter = iter(range(1, 1 << 62))
    made: dict[tuple, int] = {}  # (sweep, full block, position) or ("row", probe row) -> new key
    base_keys: dict[tuple, int] = {}  # (list, position in its block's, full block) -> new key

    def base_key(key: int, li: int, J: int) -> int:
        """The key of the baseline storage of full block J that is to its block what ``key`` is to its own."""
        same = own(J, full[li], sizes[li], period)
        if same is not None:
            return base_of[(li, same)][base_pos[key]]
        slot = (li, base_pos[key], J)
        got = base_keys.get(slot)
        if got is None:
            got = base_keys[slot] = -(1 << 40) - len(base_keys)
        return got

    def resolve(i: int, sweep: _Sweep | None, J: int | None) -> int:
        """The full model's key of the storage probe row ``i`` frees, emitted in block J of a sweep (None:
        outside the blocks)."""
        a = pair[i]
        role = sweep.role(J) if sweep is not None else None
        repeated = sweep is not None and sweep.repeated(J)
        if isinstance(a, tuple):  # a baseline storage
            key = a[1]
            if key in tagger.grown:
                raise Unsupported(f"event {i} frees an EMA's buffer of several blocks' shadows")
            owner = tagger.base_owner.get(key)
            if owner is None:
                if repeated:
                    raise Unsupported(f"every middle block frees the same storage (event {i})")
                return key
            ol, ob = owner
            if sweep is not None and ol == sweep.li:
                target = J + (ob - role)
            elif ob in (0, sizes[ol] - 1):
                target = 0 if ob == 0 else full[ol] - 1
            else:
                raise Unsupported(f"event {i} outside the blocks frees a middle block's storage")
            return base_key(key, ol, target)
        if rows[i][8] == -1:
            return -1
        s = sweep_of[a]
        if s < 0 or sweeps[s].lone:  # allocated outside the blocks, or by the first or last block alone
            if repeated:
                raise Unsupported(f"every middle block frees the same storage (event {i})")
            got = made.get(("row", a))
            if got is None:
                raise Unsupported(f"event {i} frees a storage before it is allocated")
            return got
        at = sweeps[s]
        ab = tags[a][1]
        target = J + (ab - role) if sweep is not None and at.li == sweep.li else at.absolute(ab)
        if not 0 <= target < at.n:
            raise Unsupported(f"event {i} frees a storage of a middle block from outside its list's blocks")
        got = made.get((s, target, same_event(at.runs, ab, at.role(target), pos_of[a])))
        if got is None:
            raise Unsupported(
                f"event {i} (block {J} of list {sweep.li if sweep else None}) frees a storage allocated by event "
                f"{a} (probe block {ab} of list {at.li}), which block {target} of the full model does not allocate"
            )
        return got

    out: list[tuple] = []
    source: list[int] = []

    def emit(i: int, s: int | None, J: int | None) -> None:
        row = rows[i]
        sweep = sweeps[s] if s is not None else None
        if row[1] == ALLOC:
            key = -1 if row[8] == -1 else next(counter)
            if sweep is not None and not sweep.lone:
                made[(s, J, pos_of[i])] = key
            else:
                made[("row", i)] = key
        else:
            key = resolve(i, sweep, J)
        out.append((row[0], row[1], row[2], category[i] if row[1] == ALLOC else row[3], *row[4:8], key))
        source.append(i)

    i = 0
    for s, sweep in enumerate(sweeps):
        while i < sweep.first:  # events outside the blocks
            emit(i, None, None)
            i += 1
        for J in sweep.blocks():
            for r in sweep.runs[sweep.role(J)]:
                emit(r, s, J)
        i = sweep.first + sum(len(r) for r in sweep.runs)
    while i < len(rows):
        emit(i, None, None)
        i += 1
    _check_pairs(out)
    return out, out_baseline, source


class _Sweep:
    """Consecutive probe events that go through the blocks of one list in order (or the first or last block's
    alone). In the full model the probe's blocks are their own full blocks (:func:`memkit._memo.kept`); every other
    one repeats a probe block of its phase in the checkpointing's period (1 without one) that comes after a middle
    block in the sweep: going up, the period after the first one (with ``period=1``, the third block), going down,
    the first period (the second block), so that the block before it in the sweep is a middle block too."""

    def __init__(self, li: int, first: int, runs: list[list[int]], order: list[int], n: int, period: int):
        self.li, self.first, self.runs, self.order, self.n, self.period = li, first, runs, order, n, period
        self.size = len(runs)
        self.lone = len(order) == 1
        self.down = not self.lone and order[0] > order[-1]
        # the probe blocks the sweep repeats for the blocks it leaves out (memkit._memo.head)
        first = head(period)
        self.group = range(first - period, first) if self.down else range(first, first + period)

    def role(self, J: int) -> int:
        """The probe block whose events full block J repeats."""
        if self.lone:
            return self.order[0]
        b = own(J, self.n, self.size, self.period)
        if b is not None:
            return b
        return self.group.start + (J - self.group.start) % self.period

    def repeated(self, J: int) -> bool:
        return not self.lone and self.n > self.size and self.role(J) in self.group

    def absolute(self, b: int) -> int:
        """The full block probe block b stands for outside its sweep: the first and the last block only (a middle
        block's events stand for many)."""
        if b not in (0, self.size - 1):
            raise Unsupported(f"an event outside list {self.li}'s sweeps uses its middle block {b}")
        return 0 if b == 0 else self.n - 1

    def blocks(self) -> range:
        if self.lone:
            J = self.absolute(self.order[0])
            return range(J, J + 1)
        return range(self.n - 1, -1, -1) if self.down else range(self.n)


def _filled(tags: list[Any], phases: list[int]) -> list[Any]:
    """The tags with each run of untagged events between two events of neighbouring blocks of one list, all in
    one phase, given the next event's block: per-block work that touches no block storage (Adam's ``step``
    tensor, made before the parameter's moments) belongs to the block whose work it precedes."""
    out = list(tags)
    i = 0
    while i < len(out):
        if out[i] is not None:
            i += 1
            continue
        j = i
        while j < len(out) and out[j] is None and phases[j] == phases[i]:
            j += 1
        prev = out[i - 1] if i > 0 and phases[i - 1] == phases[i] else None
        nxt = out[j] if j < len(out) and phases[j] == phases[i] else None
        if (
            prev is not None
            and nxt is not None
            and prev is not _AGG
            and nxt is not _AGG
            and prev[0] == nxt[0]
            and abs(prev[1] - nxt[1]) <= 1
        ):
            out[i:j] = [nxt] * (j - i)
        i = j
    return out


def _check_pairs(rows: list[tuple]) -> None:
    """Every storage of the spliced events freed at most once, never before it is allocated."""
    live: set[int] = set()
    allocated: set[int] = set()
    freed: set[int] = set()  # baseline storages
    for i, row in enumerate(rows):
        key = row[8]
        if key == -1:
            continue
        if row[1] == ALLOC:
            if key in live:
                raise Unsupported(f"spliced event {i} allocates a storage that is alive")
            live.add(key)
            allocated.add(key)
        elif key in live:
            live.discard(key)
        elif key in allocated or key in freed:
            raise Unsupported(f"spliced event {i} frees a storage that is not alive")
        else:
            freed.add(key)


def columns(rows: list[tuple]) -> dict[str, np.ndarray]:
    """Numpy columns of spliced rows (times made non-decreasing: repeated events keep their probe times)."""
    cols = list(zip(*rows, strict=True)) if rows else [()] * len(COLUMNS)
    out = {name: np.asarray(cols[i], dtype=dt) for i, (name, dt) in enumerate(COLUMNS)}
    if len(out["time"]):
        out["time"] = np.maximum.accumulate(out["time"])
    return out


def _grown(tagger: Tagger) -> dict[int, int]:
    """The full model's bytes of each baseline storage that holds the shadows of several blocks (an EMA's buffer),
    rounded as the tracker rounds."""
    grown = tagger.grown.items()
    return {key: tagger.tracker._round(nbytes + added) for key, (nbytes, added) in grown if key in tagger.base}


def _host_state(tagger: Tagger, tracker, meta: dict) -> dict[str, int] | None:
    """The full model's ``host_state_bytes``: an EMA's shadows kept in host memory (``mode="offload"``,
    ``"cpu_only"``), each buffer grown by the blocks the probe leaves out. Raises :class:`Unsupported` for other
    memory off the device."""
    if meta.get("host_peak_bytes"):
        raise Unsupported("the step keeps memory off the device")
    state = meta.get("host_state_bytes")
    if not state:
        return state
    if len(tracker._kept_events) != tagger.kept_events or any(key not in tagger.grown for key in tagger.kept):
        raise Unsupported("the step keeps memory off the device")  # more than an EMA's shadows, or made in the step
    out: dict[str, int] = {}
    for key, (n, category) in tagger.kept.items():
        out[category] = out.get(category, 0) + n + tagger.grown[key][1]
    return out


def spliced_timeline(tagger: Tagger, tracker, probe: Any, starts: list[int]) -> tuple[Any, list[int]]:
    """The full model's timeline from the probe's tagged events, and where each tracked step starts in it."""
    host_state = _host_state(tagger, tracker, probe.meta)
    rows, baseline, source = splice(tagger, list(tracker.log.rows), list(tracker.log.retags), tracker._baseline)
    log = tracker.log
    from .memory.timeline import Timeline

    timeline = Timeline(
        columns(rows),
        baseline_by_category=baseline,
        devices=list(log.devices.items),
        ops=list(log.ops.items),
        frames=list(log.frames.items),
        meta=dict(probe.meta),
    )
    if host_state:
        timeline.meta["host_state_bytes"] = host_state
    source_rows = np.asarray(source)
    full_starts = [int(np.argmax(source_rows >= s)) if len(source_rows) else 0 for s in starts]
    return timeline, full_starts


def spliced_baseline(tagger: Tagger, blocks: list[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
    """The full model's baseline storages from the probe's: each list's middle-block storages repeated for every
    middle block the probe left out, right after that block's own (fresh negative keys: no event frees them by key,
    a free of one pairs by size in the replay)."""
    full = [n for _, n, _ in tagger.lists]
    grown = _grown(tagger)
    blocks = [(key, grown.get(key, nbytes), device) for key, nbytes, device in blocks]
    last_of: dict[int, int] = {}  # list index -> position of its middle block's last storage
    for pos, (key, _, _) in enumerate(blocks):
        owner = tagger.base_owner.get(key)
        if owner is not None and owner[1] == 1:
            last_of[owner[0]] = pos
    out: list[tuple[int, int, int]] = []
    fresh = -(1 << 40)
    for pos, block in enumerate(blocks):
        out.append(block)
        for li, last in last_of.items():
            if last != pos:
                continue
            middle = [b for b in blocks if tagger.base_owner.get(b[0]) == (li, 1)]
            for _ in range(full[li] - len(tagger.lists[li][2])):
                for _, nbytes, device in middle:
                    fresh -= 1
                    out.append((fresh, nbytes, device))
    return out
