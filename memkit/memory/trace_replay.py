"""A real snapshot's trace replayed through the caching-allocator model: did it make the segments the GPU made?

``torch.cuda.memory._record_memory_history()`` logs every ``segment_alloc`` (a ``cudaMalloc``) and, with
``expandable_segments:True``, every ``segment_map`` (pages mapped into an expandable segment) just before the
``alloc`` that needed it. :func:`replay_trace` feeds each device's ``alloc`` and ``free_completed`` entries to
:class:`~memkit.memory.CachingAllocator` and sets each real segment event beside the ones the model made for the
same ``alloc``: same action, same bytes, or not. It checks the model against the real allocator, on any machine:
it needs no torch and costs about 10 µs a trace entry (the five public snapshots of the tests, 3,000-7,000 entries
each, take 30-110 ms).

A trace holds only the last ``max_entries`` actions, so the allocator rarely starts empty. The segments that the
trace did not make (older segments) are rebuilt first: each one made by one request of its size, then cut into
its blocks in address order while every other block is held; a block is live at the start when the trace's
first entry at its address is a free, or when the trace never touches it and the snapshot shows it allocated.
That state cannot always be expressed: a block the trace frees before allocating that no longer shows in the
segments, older expandable segments (their pages' places are unknown), or a rebuild whose segments differ from
the snapshot's. Then the device is not replayed and ``reason`` says why. ``segment_free``/``segment_unmap`` runs
are replayed as ``empty_cache()`` (torch's out-of-memory retry frees the same segments under the default settings;
the model is given no capacity, so it never runs out of memory itself).

Example:
    >>> from memkit.memory import load_snapshot, replay_trace
    >>> for device, r in replay_trace(load_snapshot("snapshot.pickle")).items():
    ...     print(f"device {device}: {r.matched} of {r.total} segments the same")
    device 0: 152 of 152 segments the same
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

from ._allocator_config import SIZE_MAX
from .caching_allocator import CachingAllocator

__all__ = ["DeviceReplay", "SegmentEvent", "recorded_alloc_conf", "replay_trace"]

MiB = 1 << 20
SEGMENT_ACTIONS = ("segment_alloc", "segment_map")
NO_TRACE = (
    "replay needs a trace: record one with torch.cuda.memory._record_memory_history() before "
    "torch.cuda.memory._dump_snapshot() (this snapshot holds the allocator's segments only)"
)


@dataclass(frozen=True)
class SegmentEvent:
    """One segment the real allocator made (``nbytes``) beside the model's for the same ``alloc``.

    ``index`` is the real entry's place in the device's trace (for a segment only the model made, the ``alloc``'s);
    ``action``/``nbytes`` are None for a segment only the model made, ``model_action``/``model_bytes`` None where
    the model made none.

    Example:
        >>> SegmentEvent(12, "segment_map", 40 << 20, 0, "segment_map", 40 << 20).same
        True
    """

    index: int
    action: str | None
    nbytes: int | None
    stream: int
    model_action: str | None
    model_bytes: int | None

    @property
    def same(self) -> bool:
        """The model made the same kind of segment, of the same bytes (both None: neither made one)."""
        return self.action == self.model_action and self.nbytes == self.model_bytes


@dataclass(frozen=True)
class DeviceReplay:
    """One device's replay: ``events`` (the real segment events in trace order, with the model's), ``start``
    (``"empty"``: the trace made every segment; ``"reconstructed"``: ``older_segments`` were rebuilt first;
    ``"not replayed"``: ``reason`` says why), the ``alloc_conf`` replayed and ``model`` (the allocator after the
    trace; None when not replayed).

    Example:
        >>> r = replay_trace(snapshot)[0]
        >>> [e.index for e in r.events if not e.same], f"{r.matched} of {r.total}"
        ([], '152 of 152')
    """

    device: int
    events: tuple[SegmentEvent, ...]
    start: Literal["empty", "reconstructed", "not replayed"]
    older_segments: int
    alloc_conf: str
    reason: str | None = None
    model: CachingAllocator | None = field(default=None, repr=False, compare=False)

    @property
    def total(self) -> int:
        """The real segment events."""
        return sum(e.action is not None for e in self.events)

    @property
    def matched(self) -> int:
        """The real segment events the model made alike."""
        return sum(e.action is not None and e.same for e in self.events)

    @property
    def same(self) -> bool:
        """Replayed, and every segment made alike, none by the model alone."""
        return self.reason is None and all(e.same for e in self.events)


def recorded_alloc_conf(snapshot: Mapping) -> str:
    """The ``PYTORCH_CUDA_ALLOC_CONF`` a snapshot recorded (newer torch writes ``allocator_settings``), else ``""``.

    Example:
        >>> recorded_alloc_conf({"allocator_settings": {"expandable_segments": True}})
        'expandable_segments:True'
    """
    settings = snapshot.get("allocator_settings") or {}
    if not isinstance(settings, Mapping):
        return ""
    if settings.get("PYTORCH_CUDA_ALLOC_CONF"):
        return str(settings["PYTORCH_CUDA_ALLOC_CONF"])
    parts = ["expandable_segments:True"] if settings.get("expandable_segments") else []
    max_split = settings.get("max_split_size")
    if isinstance(max_split, int) and 0 < max_split < SIZE_MAX:  # unset: SIZE_MAX, -1 as torch's int64
        parts.append(f"max_split_size_mb:{max_split // MiB}")
    return ",".join(parts)


def replay_trace(snapshot: Mapping, alloc_conf: str | None = None) -> dict[int, DeviceReplay]:
    """Each traced device's segment events, real and replayed, keyed by device index.

    ``alloc_conf`` defaults to :func:`recorded_alloc_conf`. Raises ValueError when the snapshot has no trace
    (replay needs ``_record_memory_history()``) or ``alloc_conf`` is one the model refuses.

    Example:
        >>> r = replay_trace(load_snapshot("snapshot.pickle"))[0]
        >>> r.start, r.matched == r.total
        ('reconstructed', True)
    """
    traces = snapshot.get("device_traces") or []
    if not any(traces):
        raise ValueError(NO_TRACE)
    conf = recorded_alloc_conf(snapshot) if alloc_conf is None else alloc_conf
    CachingAllocator(conf)  # a refused conf fails here, once, naming the option
    segments = snapshot.get("segments") or []
    return {d: _replay_device(trace, segments, d, conf) for d, trace in enumerate(traces) if trace}


class _Recording(CachingAllocator):
    """The model, noting the bytes of each segment it makes or maps (``_grow`` is called once per device alloc)."""

    def __init__(self, conf: str):
        super().__init__(conf)
        self.made: list[int] = []

    def _grow(self, n: int) -> None:
        self.made.append(n)
        super()._grow(n)


def _replay_device(trace: list, segments: list, device: int, conf: str) -> DeviceReplay:
    real = [(i, e) for i, e in enumerate(trace) if e.get("action") in SEGMENT_ACTIONS]
    older = [s for s in segments if s.get("device") == device and not _made_in(s, real)]
    start = "reconstructed" if older else "empty"
    free_action = "free_completed" if any(e.get("action") == "free_completed" for e in trace) else "free_requested"
    a = _Recording(conf)
    try:
        live = _rebuild(a, older, trace, free_action, conf)
    except _NotReplayable as e:
        return DeviceReplay(device, _unreplayed(real), "not replayed", len(older), conf, str(e))
    kind = "segment_map" if a.config.expandable_segments else "segment_alloc"
    events, pending = [], []
    for i, e in enumerate(trace):
        action = e.get("action")
        if action in SEGMENT_ACTIONS:
            pending.append((i, e))
        elif action == "alloc":
            a.made.clear()
            live[e["addr"]] = a.malloc(e["size"], stream=e.get("stream", 0))
            events += _pair(pending, a.made, kind, i, e.get("stream", 0))
            pending = []
        elif action == free_action:
            handle = live.pop(e["addr"], None)
            if handle is None:  # an inconsistent trace: a block freed twice
                reason = f"the trace frees a block at {e['addr']:#x} (entry {i}) that is not allocated then"
                events += _unreplayed(pending + [(j, x) for j, x in real if j > i])
                return DeviceReplay(device, tuple(events), "not replayed", len(older), conf, reason)
            a.free(handle)
        elif action in ("segment_free", "segment_unmap"):  # empty_cache(): once per run, the rest find nothing
            a.empty_cache()
    events += _unreplayed(pending)  # logged after the last alloc
    return DeviceReplay(device, tuple(events), start, len(older), conf, None, a)


def _unreplayed(real: list) -> tuple[SegmentEvent, ...]:
    return tuple(SegmentEvent(i, e["action"], e["size"], e.get("stream", 0), None, None) for i, e in real)


def _pair(real: list, made: list[int], kind: str, index: int, stream: int) -> list[SegmentEvent]:
    """The real segment events logged before one ``alloc``, beside the segments the model made for it."""
    out = []
    for k in range(max(len(real), len(made))):
        model = (kind, made[k]) if k < len(made) else (None, None)
        if k < len(real):
            i, e = real[k]
            out.append(SegmentEvent(i, e["action"], e["size"], e.get("stream", 0), *model))
        else:
            out.append(SegmentEvent(index, None, None, stream, *model))
    return out


def _made_in(seg: Mapping, real: list) -> bool:
    """Whether the trace made ``seg``: a ``segment_alloc`` at its address, or ``segment_map`` ranges covering it."""
    start = seg["address"]
    if not seg.get("is_expandable"):
        return any(e["action"] == "segment_alloc" and e["addr"] == start for _, e in real)
    end = start + seg["total_size"]
    for lo, hi in sorted((e["addr"], e["addr"] + e["size"]) for _, e in real if e["action"] == "segment_map"):
        if lo <= start < hi:
            start = hi
        if start >= end:
            return True
    return False


class _NotReplayable(Exception):
    """The allocator's state at the trace's start cannot be rebuilt from the snapshot."""


def _rebuild(a: CachingAllocator, older: list, trace: list, free_action: str, conf: str) -> dict:
    """Rebuild the older segments in ``a``; the live blocks at the trace's start, by address."""
    first: dict[int, str] = {}  # each address's first alloc or free in the trace
    for e in trace:
        if e.get("action") in ("alloc", free_action):
            first.setdefault(e["addr"], e["action"])
    if any(s.get("is_expandable") for s in older):
        raise _NotReplayable(
            "the trace did not map every expandable segment's pages: where older pages lie in their segment is "
            "unknown, so the allocator's state at the trace's start cannot be rebuilt"
        )
    live, to_free = {}, []
    for seg in sorted(older, key=lambda s: s["address"]):
        stream = seg.get("stream", 0)
        if seg["segment_type"] == "large":  # one request of the segment's size makes it; its blocks are cut from it
            a.free(a.malloc(seg["total_size"], stream=stream))
        address = seg["address"]
        for b in seg["blocks"]:
            n = b["size"]
            if seg["segment_type"] == "small" and n > MiB:  # a request > 1 MiB would go to the large pool
                sizes = [MiB] * (n // MiB) + [n % MiB] * bool(n % MiB)
            else:
                sizes = [n]
            handles = [a.malloc(s, stream=stream) for s in sizes]
            was = first.get(address)  # live at the start: freed first, or untouched and allocated now
            if was == free_action or (was is None and b["state"].startswith("active")):
                live[address] = handles[0]
                to_free += handles[1:]
            else:
                to_free += handles
            address += n
    for h in to_free:
        a.free(h)
    lost = [addr for addr, action in first.items() if action == free_action and addr not in live]
    if lost:
        raise _NotReplayable(
            f"the trace frees {len(lost)} block(s) allocated before it began that the snapshot's segments no longer "
            f"show (first at {lost[0]:#x}): their sizes and places at the trace's start are unknown"
        )
    want = Counter((s["segment_type"], s["total_size"], s.get("stream", 0)) for s in older)
    got = Counter((s.pool, s.size, s.stream) for s in a.segments)
    if got != want:
        raise _NotReplayable(
            f"rebuilding the older segments (alloc conf {conf!r}) made other segments than the snapshot holds "
            f"(model only: {dict(got - want)}; snapshot only: {dict(want - got)})"
        )
    return live
