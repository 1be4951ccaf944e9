"""The caching-allocator model replaying real ``torch.cuda.memory._dump_snapshot()`` traces: the segments it makes
must be the ones the GPU's allocator made, in the same order and sizes.

A corpus of two public snapshots ships with the tests (``tests/data/allocator_traces.json.gz``, 30 KB): each one's
segments and device-0 trace reduced to what the replay reads (``alloc``, ``free_completed`` and ``segment_alloc``
entries: action, address, size, stream; no frames), written by memkit's safe snapshot reader:
``JasperSolt/EoR_NN`` ``snapshot.pickle`` @ 10cd0b49 (7 segments made in the trace) and ``cranberrii/ftcourse``
``memory_snapshot.pickle`` @ a8cedf28 (152, a LoRA fine-tune of CodeQwen). More can be replayed by setting
``MEMKIT_ALLOCATOR_SNAPSHOTS`` to pickle paths (separated by ``os.pathsep``). Checked on 2026-11-26 with three more,
all equal: ``kkaitlyn111/cs336-a2-systems`` ``cs336_systems/memory_logs/memory_ctx128_forward.pickle`` (178) and
``memory_files/memory_ctx128_fullstep.pickle`` (783), ``memory_files/memory_ctx256_fullstep_.pickle`` (791) @
c1272e18. None of them uses several streams or expandable segments: those rules are checked by hand-derived cases
(tests/test_caching_allocator.py).
"""

import gzip
import json
import os
from collections import Counter
from pathlib import Path

import pytest

from memkit.memory import CachingAllocator
from memkit.memory.snapshot import load_snapshot

MiB = 1 << 20
PATHS = [p for p in os.environ.get("MEMKIT_ALLOCATOR_SNAPSHOTS", "").split(os.pathsep) if p]


def replay(snapshot: dict, device: int = 0) -> tuple[CachingAllocator, list[int], list[int]]:
    """The model after ``snapshot``'s trace, and the sizes of the segments made during it: (model, real, model's)."""
    trace = snapshot["device_traces"][device]
    made_in_trace = {e["addr"] for e in trace if e["action"] == "segment_alloc"}
    allocated_in_trace = {e["addr"] for e in trace if e["action"] == "alloc"}
    a, live, to_free = CachingAllocator(), {}, []
    # The state before the trace: each older segment made by one request of its size, then cut into its blocks in
    # address order while every other block is held (so none lands elsewhere); blocks no trace entry accounts for
    # stay allocated.
    for seg in sorted(snapshot["segments"], key=lambda s: s["address"]):
        if seg["device"] != device or seg["address"] in made_in_trace:
            continue
        if seg["segment_type"] == "large":
            a.free(a.malloc(seg["total_size"]))
        address = seg["address"]
        for b in seg["blocks"]:
            if seg["segment_type"] == "small" and b["size"] > MiB:  # a whole free small segment: 1 MiB pieces
                handles = [a.malloc(MiB) for _ in range(b["size"] // MiB)]
            else:
                handles = [a.malloc(b["size"], stream=seg["stream"])]
            if b["state"].startswith("active") and address not in allocated_in_trace:
                live[address] = handles[0]
            else:
                to_free += handles
            address += b["size"]
    for h in to_free:
        a.free(h)
    real, model = [], []
    for e in trace:
        if e["action"] == "alloc":
            before = a.reserved_bytes
            live[e["addr"]] = a.malloc(e["size"], stream=e["stream"])
            if a.reserved_bytes > before:
                model.append(a.reserved_bytes - before)
        elif e["action"] == "free_completed":
            a.free(live.pop(e["addr"]))
        elif e["action"] == "segment_alloc":
            real.append(e["size"])
    return a, real, model


CORPUS = json.loads(gzip.decompress((Path(__file__).parent / "data" / "allocator_traces.json.gz").read_bytes()))


def check(snapshot: dict) -> None:
    a, real, model = replay(snapshot)
    assert real and model == real
    assert Counter((s.pool, s.size) for s in a.segments) == Counter(
        (s["segment_type"], s["total_size"]) for s in snapshot["segments"] if s["device"] == 0
    )


@pytest.mark.parametrize("snapshot", CORPUS, ids=[s["source"].split()[0] for s in CORPUS])
def test_model_makes_the_segments_the_gpu_made(snapshot):
    check(snapshot)


@pytest.mark.skipif(not PATHS, reason="set MEMKIT_ALLOCATOR_SNAPSHOTS to snapshot pickles to replay")
@pytest.mark.parametrize("path", PATHS)
def test_model_makes_the_segments_of_snapshots_given_by_path(path):
    check(load_snapshot(path))
