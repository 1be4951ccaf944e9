"""How fast ``read_snapshot`` loads big CUDA memory snapshots, against a plain ``pickle.load`` of the same file.

A synthetic timeline (allocations of 512 B-64 MiB with short and long lifetimes from 500 call sites, each with
its own 6-frame stack, op and category, so about 1,500 distinct stacks with the phases; a 1 GiB baseline) is
written with ``write_snapshot`` in torch's schema (an ``alloc`` entry per allocation, ``free_requested`` +
``free_completed`` per free) at about 10^5 and 10^6 trace entries. Then, in turn: ``read_snapshot(path)``
(safe unpickling with every global refused, then the Timeline's numpy columns); ``pickle.load`` of the same
file, the floor any reader pays and all that torch's own tools do before parsing; and ``pickle.load`` with the
garbage collector paused, as ``read_snapshot`` does.
"""

from __future__ import annotations

import gc
import os
import pickle
import statistics
import tempfile
import time

import numpy as np

from . import Section, Table, log

TITLE = "snapshot_load: read_snapshot() vs pickle.load on 10^5 and 10^6 trace events"
TARGET_SECONDS = 5.0  # at 10^6 trace entries
_OPS = [f"aten.op{i}.default" for i in range(40)]
_SITES = 500
_FRAMES = [
    "\n".join(f"/src/train_{s % 7}.py:{10 * s + k} fn_{s}_{k}" for k in range(6)) for s in range(_SITES)
]  # outermost first, like the tracker's


def synthetic_timeline(trace_entries: int, seed: int = 0):
    """A Timeline whose snapshot has about ``trace_entries`` trace entries (95% of allocations are freed)."""
    from memkit.memory import Timeline
    from memkit.memory.events import ALLOC, CATEGORY_CODE, FREE, PHASE_CODE

    rng = np.random.default_rng(seed)
    n = int(trace_entries / 2.9)  # 1 alloc entry, 2 free entries for 95% of them
    short = rng.integers(1, 20, n)
    long = rng.integers(20, max(21, n // 4), n)
    life = np.where(rng.random(n) < 0.8, short, long).astype(np.float64)
    freed = rng.random(n) < 0.95
    t_alloc = np.arange(n, dtype=np.float64)
    t_free = t_alloc + life + 0.5
    keys = np.concatenate([t_alloc, t_free[freed]])
    order = np.argsort(keys, kind="stable")
    index = np.concatenate([np.arange(n), np.flatnonzero(freed)])[order]
    action = np.concatenate([np.full(n, ALLOC), np.full(int(freed.sum()), FREE)])[order].astype(np.int8)
    size = (2 ** rng.uniform(9, 26, n)).astype(np.int64) // 512 * 512 + 512
    # Allocations come from call sites: each site allocates with one op, in one category, under one stack.
    site = rng.integers(0, _SITES, n)
    categories = np.array([CATEGORY_CODE[c] for c in ("activation", "temporary", "gradient")], dtype=np.int8)
    category = categories[site % 3]
    m = len(index)
    phase = np.where(np.arange(m) < 0.45 * m, PHASE_CODE["forward"], PHASE_CODE["backward"])
    phase[np.arange(m) >= 0.9 * m] = PHASE_CODE["optimizer"]
    columns = {
        "time": keys[order] * 1e-5,  # 10 µs per event
        "action": action,
        "bytes": size[index],
        "category": category[index],
        "phase": phase.astype(np.int8),
        "device": np.zeros(m, dtype=np.int16),
        "op": (site % len(_OPS)).astype(np.int32)[index],
        "frame": site.astype(np.int32)[index],
        "storage": index.astype(np.int64) + 1,
    }
    return Timeline(
        columns,
        baseline_by_category={"parameter": 1 << 30},
        devices=["cuda:0"],
        ops=_OPS,
        frames=_FRAMES,
        meta={"label": "synthetic"},
    )


def _times(fn, repeats: int) -> list[float]:
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        result = fn()
        out.append(time.perf_counter() - t0)
        del result
    return out


def _plain_load(path: str):
    with open(path, "rb") as f:
        return pickle.load(f)


def _load_gc_paused(path: str):
    gc.disable()
    try:
        return _plain_load(path)
    finally:
        gc.enable()


def _case(trace_entries: int, folder: str, repeats: int) -> dict:
    from memkit.memory import read_snapshot, write_snapshot

    timeline = synthetic_timeline(trace_entries)
    path = os.path.join(folder, f"synthetic_{trace_entries}.pickle")
    t0 = time.perf_counter()
    data = write_snapshot(timeline, path)
    write_s = time.perf_counter() - t0
    entries = sum(len(t) for t in data["device_traces"])
    del data
    gc.collect()
    log(f"  {entries:,} trace entries written in {write_s:.1f} s ({os.path.getsize(path) / 2**20:.0f} MiB)")
    read = _times(lambda: read_snapshot(path), repeats)
    plain = _times(lambda: _plain_load(path), repeats)
    paused = _times(lambda: _load_gc_paused(path), repeats)
    back = read_snapshot(path)
    exact = back.peak_bytes == timeline.peak_bytes and len(back) == len(timeline)
    log(f"  read_snapshot {min(read):.2f} s, pickle.load {min(plain):.2f} s")
    return {
        "trace entries": entries,
        "events in Timeline": len(timeline),
        "file (MiB)": os.path.getsize(path) / 2**20,
        "read_snapshot (s)": min(read),
        "pickle.load (s)": min(plain),
        "pickle.load, gc paused (s)": min(paused),
        "read_snapshot / pickle.load": min(read) / min(plain),
        "read_snapshot / pickle.load gc paused": min(read) / min(paused),
        "read_snapshot median (s)": statistics.median(read),
        "write_snapshot (s)": write_s,
        "round trip exact": exact,
    }


def run(quick: bool = False) -> Section:
    sizes = (10**4, 10**5) if quick else (10**5, 10**6)
    repeats = 3
    rows = []
    with tempfile.TemporaryDirectory(prefix="memkit-bench-") as folder:
        for size in sizes:
            log(f"  ~{size:,} trace entries: {repeats} loads each")
            rows.append(_case(size, folder, repeats))
    notes = ["Times are the fastest of 3 loads each (median of read_snapshot beside it)."]
    big = [r for r in rows if r["trace entries"] >= 9 * 10**5]
    if big:
        s = big[0]["read_snapshot (s)"]
        verdict = "met" if s <= TARGET_SECONDS else "MISSED"
        notes.append(f"Target: ≤ {TARGET_SECONDS:.0f} s at 10^6 trace entries. Measured {s:.2f} s ({verdict}).")
    exact = all(r["round trip exact"] for r in rows)
    notes.append(
        "Round trip exact: read_snapshot gives back the written timeline's peak and event count"
        + ("." if exact else " - NOT for every size, see the table.")
    )
    return Section(
        name="snapshot_load",
        title=TITLE,
        text=__doc__.split("\n", 1)[1],
        tables=[Table("Synthetic snapshots, one device, pickle protocol 4", rows)],
        notes=notes,
    )
