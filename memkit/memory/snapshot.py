"""CUDA memory snapshots: read the pickles of ``torch.cuda.memory._dump_snapshot()`` into a :class:`Timeline`,
and (in ``snapshot_write.py``) write a Timeline as one for pytorch.org/memory_viz. Recording on CUDA: ``cuda.py``.

A snapshot is ``{"segments": [...], "device_traces": [[...], ...], ...}``: the allocator's segments and blocks
when it was taken, and per device the last ``max_entries`` allocator actions. Conventions, following torch's
own code (``c10/cuda/CUDACachingAllocator.cpp``, ``torch/utils/viz/MemoryViz.js``):

- **Frees.** ``free_requested`` is logged when a tensor dies, ``free_completed`` when its block can be reused
  (later only if another stream still used it, ``record_stream``). ``memory_allocated()`` drops at the request,
  but the block stays ``active_pending_free`` and unusable until completion. We count memory until
  ``free_completed``, as the memory viz's "Active Memory Timeline" does. A trace recorded with
  ``skip_actions=["free_completed"]`` falls back to ``free_requested``.
- **Sizes** are the ones the trace records, which are the requested bytes (torch logs ``orig_size`` and
  ``block->requested_size``, not the rounded block). ``alloc_granularity=512`` rounds them like the caching
  allocator (the tracker's option of the same name). The allocator's own numbers are kept in
  ``timeline.meta["reserved_bytes"]`` / ``["allocated_bytes"]``, per device.
- **Baseline.** The trace is only the last ``max_entries`` actions. Blocks allocated before it began are the
  baseline, per device: a free in the trace with no alloc before it at that address, plus every live block in
  ``segments`` that no trace alloc accounts for. For a consistent snapshot the Timeline then ends exactly at
  the live bytes of ``segments``; any difference is reported in ``meta["unaccounted_bytes"]``.
- **Devices.** Every device with a trace entry (a ``snapshot`` marker alone counts) or a segment is one of
  ``timeline.devices``; the devices' events share one time line, so ``peak_bytes`` is their sum at one moment
  and ``peak_by_device()`` each GPU's own peak. Each device keeps its trace's order: a ``time_us`` earlier
  than the entry before it (clock jitter between threads) is taken as that entry's. Traces without
  ``time_us`` (torch 2.1) are ordered by event index, ``meta["time_unit"] == "event"``; several such traces
  are laid end to end, so only each device's own peak means something. ``meta["trace_entries"]`` counts
  each device's trace entries, markers and segment actions included.
- **Categories.** Snapshots from CUDA have none, and none is guessed: events and baseline are ``"unknown"``
  (``default_category``). The ``category`` key that ``torch.cuda._memory_viz._profile_to_snapshot`` writes
  is understood (a free takes the category of its alloc). memkit writes each entry's category, phase and op
  as a first frame ``{"filename": "memkit", "line": 0, "name": "category=activation phase=forward
  op=aten.mm.default"}`` (shown on top of every stack in the viz), plus the ``category`` key that the viz
  colours by.
- **Phases and sites** come from the stacks (``_snapshot_frames.py``): frames that name ``backward`` or the
  autograd engine, ``torch/optim`` or a ``_foreach_`` op, a module's ``forward``; else "other". A free takes
  the phase of the allocation before it on its device (torch often logs a free with its allocation's stack).
  A stack without Python frames shows its nearest meaningful C++ frame, or :data:`NO_SITE`.
- **Segments.** ``meta["segments"]`` holds, per device, the segments, the blocks by state and size range, and
  the largest inactive block: all a file without a trace (``torch.cuda.memory_snapshot()``) has to say. Keys
  the reader does not use (``allocator_settings``, ``external_annotations``) are kept in ``meta``.
- **Out of memory.** Each ``oom`` entry of a trace is listed in ``meta["out_of_memory"]``: the device, the bytes
  asked for, the bytes CUDA had free, and its time (None without ``time_us``).

Loading is safe: the unpickler refuses every global, so a crafted pickle raises :class:`SnapshotError`
before it can run anything.
"""

from __future__ import annotations

import io
import os
import pickle
from collections.abc import Mapping, Sequence
from itertools import repeat
from math import isfinite
from operator import itemgetter
from typing import IO, Any

import numpy as np

from ._snapshot_frames import NO_SITE, STACK_FRAMES, Frames
from ._snapshot_schema import (
    ALLOC_ACTION,
    FREE_ACTIONS,
    HEADER_KEY,
    HEADER_VERSION,
    gc_paused,
)
from .events import ALLOC, CATEGORIES, CATEGORY_CODE, COLUMNS, FREE, PHASE_CODE, check_category, round_alloc
from .timeline import Timeline

__all__ = ["NO_SITE", "STACK_FRAMES", "SnapshotError", "load_snapshot", "read_snapshot"]

_ACTIONS = {ALLOC_ACTION: 0, FREE_ACTIONS[0]: 1, FREE_ACTIONS[1]: 2, "oom": 3}
_LIVE_STATES = frozenset(("active_allocated", "active_pending_free", "active_awaiting_free"))
# torch.profiler's memory categories (``_profile_to_snapshot`` writes them) -> memkit's
_FOREIGN_CATEGORY = {**{c: CATEGORY_CODE[c] for c in CATEGORIES}, "autograd_detail": CATEGORY_CODE["temporary"]}
_STATES = ("active_allocated", "active_pending_free", "active_awaiting_free", "inactive")
_MAX_DEVICES = 1 << 16
_READ_KEYS = frozenset(("segments", "device_traces", HEADER_KEY))


class SnapshotError(ValueError):
    """The input is not a readable CUDA memory snapshot (crafted, truncated, corrupted, or another pickle).

    Example:
        >>> try: memkit.Timeline.from_snapshot("untrusted.pickle")
        ... except memkit.memory.SnapshotError as e: print(e)   # nothing in the file was run
    """


# ---- loading ------------------------------------------------------------------------------------------------
class _NoGlobals(pickle.Unpickler):
    """Builds dicts, lists, tuples, strings and numbers; any other object would need a global: refused."""

    def find_class(self, module: str, name: str):
        raise SnapshotError(
            f"refused to load the global {module}.{name}: a memory snapshot holds only dicts, lists, strings and "
            "numbers, so this pickle is not one (it may have been crafted to run code; nothing was run)"
        )

    def persistent_load(self, pid):
        raise SnapshotError("refused a persistent id: a memory snapshot has none, so this pickle is not one")


def _unpickle(f: IO[bytes], what: str) -> Any:
    try:
        with gc_paused():
            return _NoGlobals(f).load()
    except SnapshotError:
        raise
    except EOFError as e:
        raise SnapshotError(f"{what} is truncated: the pickle ends before its end marker") from e
    except Exception as e:  # UnpicklingError, ValueError, KeyError, IndexError, MemoryError... from bad bytes
        kind = "truncated" if "truncated" in str(e) else "corrupted or not a pickle"
        raise SnapshotError(f"{what} is {kind}: {type(e).__name__}: {e}") from e


def load_snapshot(source: str | os.PathLike | bytes | IO[bytes] | Mapping | list) -> dict:
    """Load a snapshot as torch's plain dict, safely, and check that it is one (see :func:`read_snapshot`).

    A bare list is taken as the segments of ``torch.cuda.memory_snapshot()``, as torch's own CLI does.

    Example:
        >>> data = load_snapshot("snapshot.pickle")
        >>> html = torch.cuda._memory_viz.trace_plot(data)
    """
    if isinstance(source, (str, os.PathLike)):
        with open(source, "rb") as f:
            data = _unpickle(f, f"snapshot file {os.fspath(source)!r}")
    elif isinstance(source, (bytes, bytearray, memoryview)):
        data = _unpickle(io.BytesIO(source), "the snapshot bytes")
    elif hasattr(source, "read"):
        data = _unpickle(source, f"snapshot file {getattr(source, 'name', '<file object>')!r}")
    elif isinstance(source, (Mapping, list)):
        data = source
    else:
        raise TypeError(
            f"source must be a path, bytes, a binary file object or a loaded snapshot dict, got {type(source).__name__}"
        )
    if isinstance(data, list):
        data = {"segments": data, "device_traces": []}
    if not isinstance(data, Mapping):
        raise SnapshotError(
            f"not a CUDA memory snapshot: expected a dict with 'segments' and 'device_traces' "
            f"(torch.cuda.memory._snapshot()), got a {type(data).__name__}"
        )
    missing = [k for k in ("segments", "device_traces") if k not in data]
    if missing:
        found = sorted(map(str, data))[:8]
        raise SnapshotError(f"not a CUDA memory snapshot: missing {missing} (keys found: {found})")
    segments, traces = data["segments"], data["device_traces"]
    if not isinstance(segments, list) or not all(isinstance(s, Mapping) for s in segments):
        raise SnapshotError("not a CUDA memory snapshot: 'segments' must be a list of dicts")
    if not isinstance(traces, list) or not all(isinstance(t, list) for t in traces):
        raise SnapshotError("not a CUDA memory snapshot: 'device_traces' must be a list (one per device) of lists")
    return data if isinstance(data, dict) else dict(data)


# ---- reading --------------------------------------------------------------------------------------------------
def _bad_entry(trace: list, device: int) -> str:
    for i, e in enumerate(trace):
        if not isinstance(e, Mapping) or "action" not in e:
            return f"device_traces[{device}][{i}] is not a trace entry (a dict with 'action'): {str(e)[:120]}"
        if e["action"] in (ALLOC_ACTION, *FREE_ACTIONS) and not all(k in e for k in ("addr", "size")):
            return f"device_traces[{device}][{i}] ({e['action']}) lacks 'addr' or 'size': {str(e)[:120]}"
    return f"device_traces[{device}] holds a malformed entry"


def _device_events(
    trace: list, device: int, frames: Frames, free_text: bool
) -> tuple[dict[str, np.ndarray], str, list[Mapping]]:
    """One device's alloc and free events as arrays, in trace order, and its ``oom`` entries. A free keeps its
    stack text only when ``free_text`` (memkit's snapshots); in torch's it is where the tensor died, which the
    tracker doesn't record."""
    # C-level map/itemgetter pipelines: at 10^6 entries, a Python loop per entry would cost more than unpickling
    try:
        act = np.fromiter(map(_ACTIONS.get, map(itemgetter("action"), trace), repeat(-1)), np.int8, len(trace))
        # a trace recorded with skip_actions=["free_completed"] only has the requests
        free_code = 1 if (act == 1).any() and not (act == 2).any() else 2
        keep = np.flatnonzero((act == 0) | (act == free_code))
        ooms = [trace[i] for i in np.flatnonzero(act == 3).tolist()]
        sel = trace if len(keep) == len(trace) else list(map(trace.__getitem__, keep.tolist()))
        n = len(sel)
        addr = np.fromiter(map(itemgetter("addr"), sel), np.int64, n)
        size = np.fromiter(map(itemgetter("size"), sel), np.int64, n)
        stacks = list(map(dict.get, sel, repeat("frames")))
        foreign = list(map(dict.get, sel, repeat("category")))
        try:
            time_us = np.fromiter(map(itemgetter("time_us"), sel), np.float64, n)
        except (KeyError, TypeError):
            time_us = np.full(n, np.nan)
    except (KeyError, TypeError, ValueError, OverflowError, AttributeError) as e:
        raise SnapshotError(f"not a CUDA memory snapshot: {_bad_entry(trace, device)}") from e
    codes = np.empty((n, 4), dtype=np.int64)
    is_alloc = act[keep] == 0
    for rows, with_text in ((np.flatnonzero(is_alloc), True), (np.flatnonzero(~is_alloc), free_text)):
        picked = stacks if len(rows) == n else list(map(stacks.__getitem__, rows.tolist()))
        codes[rows] = frames.codes(picked, with_text=with_text)
    category = codes[:, 0]
    if foreign.count(None) != n:
        named = np.array([_FOREIGN_CATEGORY.get(c, -1) if isinstance(c, str) else -1 for c in foreign], np.int64)
        category = np.where(category >= 0, category, named)
    cols = {
        "time": time_us,
        "action": np.where(is_alloc, ALLOC, FREE).astype(np.int8),
        "bytes": size,
        "category": category,
        "phase": codes[:, 1],
        "device": np.full(n, device, dtype=np.int64),
        "op": codes[:, 2],
        "frame": codes[:, 3],
        "storage": addr,
    }
    return cols, FREE_ACTIONS[free_code - 1], ooms


def _pair(cols: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray, set[tuple[int, int]]]:
    """Pair each free with the alloc before it at the same address and device.

    Returns the alloc index of each free (-1: allocated before the trace), and the (device, address) of the
    allocations still live at the end of the trace.
    """
    n = len(cols["action"])
    alloc_of = np.full(n, -1, dtype=np.int64)
    if n == 0:
        return alloc_of, np.zeros(0, dtype=bool), set()
    dev, addr, act = cols["device"], cols["storage"], cols["action"]
    order = np.lexsort((np.arange(n), addr, dev))
    d, a, x = dev[order], addr[order], act[order]
    same_as_prev = np.zeros(n, dtype=bool)
    same_as_prev[1:] = (d[1:] == d[:-1]) & (a[1:] == a[:-1])
    paired = np.zeros(n, dtype=bool)
    paired[1:] = same_as_prev[1:] & (x[1:] == FREE) & (x[:-1] == ALLOC)
    alloc_of[order[paired]] = order[np.flatnonzero(paired) - 1]
    last = np.ones(n, dtype=bool)
    last[:-1] = ~same_as_prev[1:]
    live = last & (x == ALLOC)
    return alloc_of, act == FREE, set(zip(d[live].tolist(), a[live].tolist(), strict=True))


def read_snapshot(
    source: str | os.PathLike | bytes | IO[bytes] | Mapping | list,
    *,
    default_category: str = "unknown",
    alloc_granularity: int | None = None,
    device_names: Sequence[str] | None = None,
) -> Timeline:
    """Read a CUDA memory snapshot (a path, bytes, a binary file or the loaded dict) as a :class:`Timeline`.

    Each ``alloc`` becomes an allocation and each ``free_completed`` a free (see the module docstring for why),
    with time in seconds since the first event (the event's index when entries have no ``time_us``), device
    ``"cuda:N"`` (``device_names`` to rename; memkit's own snapshots keep their names), storage = address, and
    the innermost frames as the frame text. Memory allocated before the trace began is the baseline, so the
    Timeline ends at what ``segments`` says is live. Categories come from memkit's marker frame or a
    ``category`` key, else ``default_category``. Pickles are loaded without ever importing a global: crafted,
    truncated or foreign files raise :class:`SnapshotError`. 10^6 events take a few seconds, mostly unpickling.

    Example:
        >>> torch.cuda.memory._dump_snapshot("snapshot.pickle")      # after _record_memory_history()
        >>> tl = read_snapshot("snapshot.pickle")
        >>> tl.peak_bytes, tl.meta["reserved_bytes"]
    """
    default = check_category(default_category)
    if alloc_granularity is not None and (not isinstance(alloc_granularity, int) or alloc_granularity < 1):
        raise ValueError(f"alloc_granularity must be a positive int or None, got {alloc_granularity!r}")
    with gc_paused():
        data = load_snapshot(source)
        return _to_timeline(data, default, alloc_granularity, device_names)


def _header(data: Mapping) -> dict:
    header = data.get(HEADER_KEY)
    return header if isinstance(header, dict) and header.get("version") == HEADER_VERSION else {}


def _events(traces: list, frames: Frames, header: dict) -> tuple[dict[str, np.ndarray], dict[int, str], str, list]:
    """Every device's events in time order (trace order when there are no times), times relative; and the
    out-of-memory errors the traces logged, as ``(device, entry, time)``."""
    per_device, free_actions, ooms = [], {}, []
    for d, trace in enumerate(traces):
        if trace:
            cols, free_actions[d], found = _device_events(trace, d, frames, free_text=bool(header))
            per_device.append(cols)
            ooms += [(d, e) for e in found]
    if not sum(len(c["action"]) for c in per_device):  # no trace, or markers and segment actions only
        return (
            {name: np.zeros(0, dtype=np.float64 if name == "time" else np.int64) for name, _ in COLUMNS},
            free_actions,
            "s",
            [(d, e, None) for d, e in ooms],
        )
    for c in per_device:  # trace order is the allocator's: a time before the entry above it is clock jitter
        c["time"] = np.maximum.accumulate(c["time"])
    cols = {k: np.concatenate([c[k] for c in per_device]) for k in per_device[0]}
    t = cols["time"]
    if np.isnan(t).any():
        cols["time"] = np.arange(len(t), dtype=np.float64)
        return cols, free_actions, "event", [(d, e, None) for d, e in ooms]
    if len(per_device) > 1:
        order = np.argsort(t, kind="stable")
        cols = {k: v[order] for k, v in cols.items()}
    zero = header.get("time_zero_us")
    zero = float(zero) if isinstance(zero, (int, float)) else float(cols["time"].min())
    cols["time"] = (cols["time"] - zero) / 1e6
    at = [None if (us := _int_or_none(e.get("time_us"))) is None else (us - zero) / 1e6 for _, e in ooms]
    return cols, free_actions, "s", [(d, e, t) for (d, e), t in zip(ooms, at, strict=True)]


def _size_bucket(nbytes: int) -> str:
    """The power-of-two range of a block size, as a label: "<512 B" ... "1-2 GiB"."""
    if nbytes < 512:
        return "<512 B"
    low = 1 << (nbytes.bit_length() - 1)
    unit, scale = next((u, k) for u, k in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10), ("B", 1)) if low >= k)
    return f"{low // scale}-{2 * low // scale} {unit}"


class _Segments:
    """What the allocator's segments say, per device: the live blocks no trace alloc explains (the baseline, by
    category), totals (reserved, allocated, live), and the blocks by state and size."""

    def __init__(self):
        self.baseline: dict[int, np.ndarray] = {}
        self.totals: dict[str, dict[int, int]] = {k: {} for k in ("reserved", "allocated", "live", "live_before")}
        self.summary: dict[int, dict[str, Any]] = {}

    def add(self, kind: str, device: int, nbytes: int) -> None:
        self.totals[kind][device] = self.totals[kind].get(device, 0) + nbytes

    def device(self, d: int) -> dict[str, Any]:
        if d not in self.summary:
            self.baseline[d] = np.zeros(len(CATEGORIES), dtype=np.int64)
            self.summary[d] = {
                "segments": 0,
                "expandable_segments": 0,
                "reserved_bytes": 0,
                "blocks": {state: {"count": 0, "bytes": 0} for state in _STATES},
                "largest_inactive_block": 0,
                "blocks_by_size": {},  # size range -> state -> count
            }
        return self.summary[d]

    def read(self, data, live_from_trace, frames, default, granularity) -> _Segments:
        for s, seg in enumerate(data["segments"]):
            try:
                self._segment(seg, live_from_trace, frames, default, granularity)
            except (KeyError, TypeError, ValueError, AttributeError, OverflowError) as e:
                raise SnapshotError(f"not a CUDA memory snapshot: segments[{s}] is malformed ({e!r})") from e
        return self

    def _segment(self, seg, live_from_trace, frames, default, granularity) -> None:
        d = int(seg.get("device", 0))
        if not 0 <= d < _MAX_DEVICES:
            raise ValueError(f"device {d} is not a device index")
        info = self.device(d)
        total = int(seg.get("total_size", 0))
        self.add("reserved", d, total)
        info["segments"] += 1
        info["expandable_segments"] += bool(seg.get("is_expandable"))
        info["reserved_bytes"] += total
        address = int(seg.get("address") or 0)  # blocks tile the segment; older snapshots omit their address
        for b in seg.get("blocks", ()):
            block_addr, size, state = int(b.get("address", address)), int(b["size"]), b.get("state")
            address = block_addr + size
            stats = info["blocks"].setdefault(str(state), {"count": 0, "bytes": 0})
            stats["count"] += 1
            stats["bytes"] += size
            by_state = info["blocks_by_size"].setdefault(_size_bucket(size), {})
            by_state[str(state)] = by_state.get(str(state), 0) + 1
            if state not in _LIVE_STATES:
                info["largest_inactive_block"] = max(info["largest_inactive_block"], size)
                continue
            if state == "active_allocated":
                self.add("allocated", d, size)
            nbytes = round_alloc(int(b.get("requested_size", size)), granularity)
            self.add("live", d, nbytes)
            if (d, block_addr) not in live_from_trace:
                code = frames.decode(b.get("frames"), with_text=False)[0]
                self.baseline[d][code if code >= 0 else _FOREIGN_CATEGORY.get(b.get("category"), default)] += nbytes
                self.add("live_before", d, nbytes)


def _int_or_none(value: Any) -> int | None:
    return int(value) if isinstance(value, (int, float)) and not isinstance(value, bool) and isfinite(value) else None


def _phase_of_frees(cols: dict[str, np.ndarray]) -> None:
    """A free without memkit's marker takes the phase of the allocation before it on its device: the phase is a
    moment's, and torch often logs a free with its allocation's stack, which would name the wrong one."""
    phase, is_alloc, device = cols["phase"], cols["action"] == ALLOC, cols["device"]
    if not (~is_alloc & (phase < 0)).any():
        return
    for d in np.unique(device).tolist():
        rows = np.flatnonzero(device == d)
        allocs = is_alloc[rows]
        last = np.maximum.accumulate(np.where(allocs, np.arange(len(rows)), -1))
        fill = ~allocs & (phase[rows] < 0) & (last >= 0)
        phase[rows[fill]] = phase[rows[last[fill]]]


def _to_timeline(data: Mapping, default: int, granularity: int | None, device_names) -> Timeline:
    header = _header(data)
    frames = Frames([], [])
    traces = data["device_traces"]
    cols, free_actions, time_unit, ooms = _events(traces, frames, header)
    cols["bytes"] = round_alloc(cols["bytes"], granularity)

    # a free belongs to the category of its alloc; what stays unknown gets the default
    alloc_of, is_free, live_from_trace = _pair(cols)
    cat = cols["category"]
    has_alloc = alloc_of >= 0
    cat[has_alloc] = cat[alloc_of[has_alloc]]
    cat[cat < 0] = default
    _phase_of_frees(cols)
    cols["phase"][cols["phase"] < 0] = PHASE_CODE["other"]

    # devices: every one with a trace entry (even a marker alone) or a segment, in index order; names from the
    # caller, memkit's header, or "cuda:N"
    segments = _Segments().read(data, live_from_trace, frames, default, granularity)
    used = sorted({d for d, trace in enumerate(traces) if trace} | set(segments.summary))
    for d in used:
        segments.device(d)
    named = header.get("devices") if isinstance(header.get("devices"), dict) else {}
    if device_names is not None:
        named = dict(enumerate(device_names))
    names = {d: str(named.get(d, f"cuda:{d}")) for d in used}
    remap = np.zeros(max(used, default=0) + 1, dtype=np.int64)
    remap[used] = np.arange(len(used))
    cols["device"] = remap[cols["device"]]

    # baseline, per device: live blocks that no trace alloc explains, plus frees of blocks allocated before the
    # trace
    before = is_free & ~has_alloc
    k = len(CATEGORIES)
    pre_freed = np.bincount(
        cols["device"][before] * k + cat[before], weights=cols["bytes"][before], minlength=len(used) * k
    )
    pre_freed = pre_freed.astype(np.int64).reshape(len(used), k)
    baseline = {names[d]: segments.baseline[d] + pre_freed[i] for i, d in enumerate(used)}

    # for a consistent snapshot, baseline + events end at what the segments hold
    signed = np.where(cols["action"] == ALLOC, cols["bytes"], -cols["bytes"])
    net = np.bincount(cols["device"], weights=signed, minlength=len(used))
    net += np.bincount(cols["device"][before], weights=cols["bytes"][before], minlength=len(used))
    totals = segments.totals
    meta: dict[str, Any] = {"source": "snapshot", "time_unit": time_unit}
    meta["trace_entries"] = {names[d]: len(traces[d]) for d in used if d < len(traces)}
    for key, kind in (("reserved_bytes", "reserved"), ("allocated_bytes", "allocated")):
        meta[key] = {names[d]: v for d, v in totals[kind].items()}
    meta["free_action"] = {names[d]: a for d, a in free_actions.items()}
    meta["segments"] = {names[d]: segments.summary[d] for d in used}
    unaccounted = {
        names[d]: diff
        for i, d in enumerate(used)
        if (diff := totals["live"].get(d, 0) - totals["live_before"].get(d, 0) - int(net[i]))
    }
    if unaccounted:
        meta["unaccounted_bytes"] = unaccounted
    if ooms:
        meta["out_of_memory"] = [
            {
                "device": names[d],
                "requested_bytes": _int_or_none(e.get("size")),
                "device_free_bytes": _int_or_none(e.get("device_free")),
                "time": t,
            }
            for d, e, t in ooms
        ]
    for key, value in (header.get("meta") or {}).items():
        meta.setdefault(key, value)
    if (header.get("meta") or {}).get("time_unit") == "event":  # memkit wrote event indices as its times
        meta["time_unit"] = "event"
    for key, value in data.items():  # allocator_settings, external_annotations...: nothing is dropped
        if key not in _READ_KEYS:
            meta.setdefault(str(key), value)
    return Timeline(
        cols,
        baseline_by_device={
            name: {c: int(row[i]) for i, c in enumerate(CATEGORIES) if row[i]} for name, row in baseline.items()
        },
        devices=list(names.values()),
        ops=frames.ops,
        frames=frames.texts,
        meta=meta,
    )
