"""How fast ``CachingAllocator`` replays allocations, against the least any replay costs.

A synthetic sequence (sizes 2^U(9, 26) bytes, i.e. 512 B-64 MiB; 80% of blocks live 1-19 allocations, the rest
up to n/50) is replayed as ``malloc``/``free`` calls in time order through ``CachingAllocator`` under three
settings, and through a baseline that only keeps the live blocks in a dict and sums their 512-byte-rounded bytes
(what counting *allocated* memory costs). Both pay the same loop and heap of pending frees, so the ratio is the
price of modelling *reserved* memory. Rounds are interleaved; the fastest of each is kept.
"""

from __future__ import annotations

import heapq
import time

import numpy as np

from . import Section, Table, log

TITLE = "caching_allocator: CachingAllocator replay speed (calls/s) vs counting allocated bytes"
CONFS = ("", "expandable_segments:True", "max_split_size_mb:64,roundup_power2_divisions:4")


def events(n: int, seed: int = 0) -> tuple[list[int], list[int]]:
    """``n`` allocation sizes and lifetimes (in allocations)."""
    rng = np.random.default_rng(seed)
    size = (2 ** rng.uniform(9, 26, n)).astype(np.int64).tolist()
    life = np.where(rng.random(n) < 0.8, rng.integers(1, 20, n), rng.integers(20, max(21, n // 50), n)).tolist()
    return size, life


def _replay(malloc, free, size: list[int], life: list[int]) -> tuple[int, float]:
    pending: list[tuple[int, int, object]] = []
    calls, t0 = 0, time.perf_counter()
    for i, (s, n) in enumerate(zip(size, life, strict=True)):
        while pending and pending[0][0] <= i:
            free(heapq.heappop(pending)[2])
            calls += 1
        heapq.heappush(pending, (i + n, i, malloc(s)))
        calls += 1
    while pending:
        free(heapq.heappop(pending)[2])
        calls += 1
    return calls, time.perf_counter() - t0


class _Counter:
    """The baseline: live blocks in a dict, allocated bytes summed (no segments, no cache)."""

    def __init__(self):
        self.live, self.next, self.allocated, self.peak = {}, 0, 0, 0

    def malloc(self, n: int) -> int:
        self.next += 1
        size = max(512, -(-n // 512) * 512)
        self.live[self.next] = size
        self.allocated += size
        self.peak = max(self.peak, self.allocated)
        return self.next

    def free(self, handle: int) -> None:
        self.allocated -= self.live.pop(handle)


def run(quick: bool = False) -> Section:
    from memkit.memory import CachingAllocator

    rows = []
    for n in (20_000,) if quick else (50_000, 500_000):
        size, life = events(n)
        best: dict[str, tuple[int, float, int]] = {}
        for _ in range(1 if quick else 3):
            counter = _Counter()
            calls, dt = _replay(counter.malloc, counter.free, size, life)
            if "baseline" not in best or dt < best["baseline"][1]:
                best["baseline"] = (calls, dt, counter.peak)
            for conf in CONFS:
                a = CachingAllocator(conf)
                calls, dt = _replay(a.malloc, a.free, size, life)
                if conf not in best or dt < best[conf][1]:
                    best[conf] = (calls, dt, a.max_reserved_bytes)
            log(f"{n:,} allocations: round done")
        base = best.pop("baseline")
        for conf, (calls, dt, peak) in best.items():
            rows.append(
                {
                    "allocations": n,
                    "conf": conf or "(default)",
                    "calls": calls,
                    "seconds": dt,
                    "calls/s": calls / dt,
                    "µs/call": dt / calls * 1e6,
                    "time / baseline": dt / base[1],
                    "max reserved / max allocated": peak / base[2],
                }
            )
        rows.append(
            {
                "allocations": n,
                "conf": "baseline (dict)",
                "calls": base[0],
                "seconds": base[1],
                "calls/s": base[0] / base[1],
                "µs/call": base[1] / base[0] * 1e6,
                "time / baseline": 1.0,
            }
        )
    return Section(
        name="caching_allocator",
        title=TITLE,
        text=__doc__.split("\n", 1)[1],
        tables=[Table("Replay of malloc/free calls (the fastest round of each)", rows)],
        notes=["Target: a few µs per call, so that 10^6 events replay in seconds."],
    )
