"""Writing a :class:`Timeline` as a CUDA memory snapshot in torch's schema (pickle protocol 4), which torch's
``torch.cuda._memory_viz`` tools and pytorch.org/memory_viz open. memkit's category, phase and op ride along
as a marker frame (``_snapshot_schema.py``; ``snapshot.py`` reads them back); addresses are synthesised,
512-byte aligned and reused only after a free, inside one 2 MiB-aligned segment per device.
"""

from __future__ import annotations

import os
import pickle
import re
import time
from typing import Any

from ._snapshot_schema import ALLOC_ACTION, FREE_ACTIONS, HEADER_KEY, HEADER_VERSION, gc_paused, marker_frame, stack_of
from .events import ALLOC, CATEGORIES, CATEGORY_CODE, COLUMNS, CUDA_BLOCK, PHASE_CODE, round_alloc
from .timeline import Timeline

__all__ = ["write_snapshot"]

_ADDRESS_BASE = 0x7F0000000000
_SEGMENT_ALIGN = 2 << 20  # large segments are multiples of 2 MiB


def _plain(value: Any) -> bool:
    """Pickles without a global: builtin types only (numpy's float64 and str_ subclass float and str, but would
    need numpy's globals, which the reader refuses and the viz cannot unpickle)."""
    return value is None or type(value) in (bool, int, float, str)


class _Addresses:
    """Addresses for one device: reuse a freed block of the same rounded size, else grow. Unique while live."""

    def __init__(self, base: int):
        self.base, self.top = base, base
        self._free: dict[int, list[int]] = {}

    def alloc(self, rounded: int) -> int:
        pool = self._free.get(rounded)
        if pool:
            return pool.pop()
        addr, self.top = self.top, self.top + rounded
        return addr

    def free(self, addr: int, rounded: int) -> None:
        self._free.setdefault(rounded, []).append(addr)


def _entry(action: str, addr: int, size: int, time_us: int, frames: list, **extra: Any) -> dict:
    return {"action": action, "addr": addr, "size": size, "stream": 0, "time_us": time_us, "frames": frames, **extra}


def _block(addr: int, size: int, requested: int, frames: list | None = None) -> dict:
    state = "inactive" if frames is None else "active_allocated"
    return {"address": addr, "size": size, "requested_size": requested, "state": state, "frames": frames or []}


def write_snapshot(timeline: Timeline, path: str | os.PathLike | None = None) -> dict:
    """Write ``timeline`` as a CUDA memory snapshot in torch's schema; return the dict (saved to ``path`` if given).

    torch's ``_memory_viz`` functions and pytorch.org/memory_viz open it: allocations are ``alloc`` entries,
    frees ``free_requested`` + ``free_completed`` pairs, addresses are synthesized (512-byte aligned, reused only
    once free), one segment per device holds the blocks live at the end, and the baseline is live from before
    the trace (blocks per category; baseline storages freed in the window become blocks that the trace frees).
    Each entry carries memkit's marker frame, so :func:`read_snapshot` gives back the same bytes, actions,
    categories, phases and ops. Pickle protocol 4, the newest the viz reads.

    Example:
        >>> with memkit.track(model, inputs=inputs) as tl:
        ...     memkit.train_step(model, inputs)
        >>> write_snapshot(tl, "step.pickle")          # drag onto pytorch.org/memory_viz
    """
    if not isinstance(timeline, Timeline):
        raise TypeError(f"timeline must be a memkit Timeline, got {type(timeline).__name__}")
    with gc_paused():
        data = _snapshot_of(timeline)
        if path is not None:
            tmp = f"{os.fspath(path)}.tmp"
            with open(tmp, "wb") as f:
                pickle.dump(data, f, protocol=4)
            os.replace(tmp, path)
    return data


def _snapshot_of(timeline: Timeline) -> dict:
    c = {name: timeline.column(name).tolist() for name, _ in COLUMNS}
    names = timeline.devices or ["cuda:0"]
    indices = _device_indices(names)
    zero_us = int(time.time() * 1e6)

    stacks: dict[tuple, list] = {}

    def stack(category: int, phase: int, op: int, frame: int) -> list:
        key = (category, phase, op, frame)
        s = stacks.get(key)
        if s is None:
            op_name = timeline.ops[op] if 0 <= op < len(timeline.ops) else None
            text = timeline.frames[frame] if 0 <= frame < len(timeline.frames) else None
            s = stacks[key] = [marker_frame(category, phase, op_name), *stack_of(text)]
        return s

    # storages freed in the window but allocated before it: they are part of the baseline
    live: dict[int, int] = {}
    before: list[int] = []
    for i, (action, key) in enumerate(zip(c["action"], c["storage"], strict=True)):
        if action == ALLOC:
            live[key] = i
        elif live.pop(key, None) is None:
            before.append(i)
    # the baseline still live at the end, per device when the timeline knows its split, else on the first device
    if timeline.baseline_by_device is not None and timeline.devices:
        remainder = {indices[d]: timeline.on_device(d).baseline_by_category for d in timeline.devices}
    else:
        first = names[c["device"][0]] if c["action"] else names[0]
        remainder = {indices[d]: dict.fromkeys(CATEGORIES, 0) for d in names}
        remainder[indices[first]] = timeline.baseline_by_category
    for i in before:
        d = indices[names[c["device"][i]]]
        if d not in remainder or timeline.baseline_by_device is None:
            d = max(remainder, key=lambda k: sum(remainder[k].values()))
        remainder[d][CATEGORIES[c["category"][i]]] -= c["bytes"][i]
    short = {(d, k): -v for d, rem in remainder.items() for k, v in rem.items() if v < 0}
    if short:
        raise ValueError(f"timeline frees more bytes of pre-window storages than its baseline holds: {short}")

    traces: list[list[dict]] = [[] for _ in range(max(indices.values()) + 1)]
    spaces = {d: _Addresses(_ADDRESS_BASE + d * (1 << 40)) for d in indices.values()}
    blocks: dict[int, dict[int, dict]] = {d: {} for d in indices.values()}  # live blocks by address
    for d, rem in remainder.items():
        for category, nbytes in rem.items():
            if nbytes > 0:
                code = CATEGORY_CODE[category]
                _add_block(blocks[d], spaces[d], nbytes, stack(code, PHASE_CODE["other"], -1, -1))
    before_addr = {}
    for i in before:
        d = indices[names[c["device"][i]]]
        s = stack(c["category"][i], PHASE_CODE["other"], -1, -1)
        before_addr[i] = _add_block(blocks[d], spaces[d], c["bytes"][i], s)

    open_: dict[int, tuple[int, int]] = {}  # storage key -> (device index, address)
    for i in range(len(c["action"])):
        d = indices[names[c["device"][i]]]
        nbytes, key = c["bytes"][i], c["storage"][i]
        time_us = zero_us + round(c["time"][i] * 1e6)
        s = stack(c["category"][i], c["phase"][i], c["op"][i], c["frame"][i])
        if c["action"][i] == ALLOC:
            if key in open_:  # allocated twice without a free: the first stays live
                del open_[key]
            addr = _add_block(blocks[d], spaces[d], nbytes, s)
            open_[key] = (d, addr)
            traces[d].append(_entry(ALLOC_ACTION, addr, nbytes, time_us, s, category=CATEGORIES[c["category"][i]]))
            continue
        d, addr = open_.pop(key) if i not in before_addr else (d, before_addr[i])
        block = blocks[d].pop(addr)
        spaces[d].free(addr, block["size"])
        traces[d] += [_entry(a, addr, nbytes, time_us, s) for a in FREE_ACTIONS]
    end_us = zero_us + round((c["time"][-1] if c["time"] else 0.0) * 1e6)
    for trace in traces:
        if trace:  # the viz colours by category and crashes unless "unknown" is one (a typo in MemoryViz.js)
            trace.append(_entry("snapshot", 0, 0, end_us, [], category="unknown"))
    return {
        "segments": [_segment(d, spaces[d], blocks[d]) for d in sorted(spaces) if spaces[d].top > spaces[d].base],
        "device_traces": traces,
        "allocator_settings": timeline.meta.get("allocator_settings", {}),
        "external_annotations": timeline.meta.get("external_annotations", []),
        HEADER_KEY: {
            "version": HEADER_VERSION,
            "devices": {indices[name]: name for name in names},
            "time_zero_us": zero_us,
            "meta": {k: v for k, v in timeline.meta.items() if isinstance(k, str) and _plain(v)},
        },
    }


def _device_indices(names: list[str]) -> dict[str, int]:
    """``cuda:N`` keeps index N when every device is a CUDA one; otherwise devices are numbered in order."""
    m = [re.fullmatch(r"cuda:(\d+)", n) for n in names]
    if all(m) and len({int(x[1]) for x in m}) == len(names):
        return {n: int(x[1]) for n, x in zip(names, m, strict=True)}
    return {n: i for i, n in enumerate(names)}


def _add_block(blocks: dict[int, dict], space: _Addresses, nbytes: int, frames: list) -> int:
    rounded = round_alloc(nbytes, CUDA_BLOCK)
    addr = space.alloc(rounded)
    blocks[addr] = _block(addr, rounded, nbytes, frames)
    return addr


def _segment(device: int, space: _Addresses, live: dict[int, dict]) -> dict:
    """One segment tiled by the live blocks and the gaps between them, as the allocator reports it."""
    end = space.base + -(-(space.top - space.base) // _SEGMENT_ALIGN) * _SEGMENT_ALIGN
    blocks, cursor = [], space.base
    for addr in [*sorted(live), end]:
        if addr > cursor:
            blocks.append(_block(cursor, addr - cursor, 0))
        if addr < end:
            blocks.append(live[addr])
            cursor = addr + live[addr]["size"]
    allocated = sum(b["size"] for b in live.values())
    return {
        "device": device,
        "address": space.base,
        "total_size": end - space.base,
        "allocated_size": allocated,
        "active_size": allocated,
        "requested_size": sum(b["requested_size"] for b in live.values()),
        "stream": 0,
        "segment_type": "large",
        "segment_pool_id": (0, 0),
        "is_expandable": False,
        "frames": [],
        "blocks": blocks,
    }
