"""The caching-allocator model replaying real ``torch.cuda.memory._dump_snapshot()`` traces
(:func:`memkit.memory.replay_trace`): the segments it makes must be the ones the GPU's allocator made, in the same
order and sizes, at the same ``alloc``.

A corpus of five public snapshots ships with the tests (``tests/data/allocator_traces.json.gz``, 85 KB), each
reduced to what the replay reads: the segments (device, address, size, stream, pool, expandable, each block's size
and state), each device's trace cut to its ``alloc``, ``free_completed`` and ``segment_*`` entries (action,
address, size, stream; no frames: trace indices are those of the reduced trace) and the allocator settings the
replay reads. Segments made in the trace, by snapshot:

- ``JasperSolt/EoR_NN`` ``snapshot.pickle`` @ 10cd0b49: 7 ``segment_alloc`` (device 0 kept; entries with ``time_us``);
- ``cranberrii/ftcourse`` ``memory_snapshot.pickle`` @ a8cedf28: 152 (a LoRA fine-tune of CodeQwen; device 0 kept;
  no ``time_us``, as torch 2.1 wrote);
- ``Maphsge4/select_n`` ``snapshot.pickle`` @ 04d383cd: 584, with 579 ``segment_free`` (``empty_cache()`` between
  steps), 131 older segments, one of them on a second stream; no ``time_us``;
- ``Constructor-Sun/code_location`` ``memory_snapshot.pickle`` @ 52e52b22: ``expandable_segments:True`` (recorded
  in ``allocator_settings``), three GPUs with 175, 40 and 78 ``segment_map``, 6 ``segment_unmap`` after an
  out-of-memory error; every trace starts from an empty allocator;
- ``MAGMA27/assignment2-systems`` ``memory_snapshot.pickle`` @ 15883f2b: the newest format (``user_metadata``,
  ``graph_capture_record_stream_reuse``); its trace makes no segment, so what it checks is that the 216 older
  segments are rebuilt and that the model makes none either.

More can be replayed by setting ``MEMKIT_ALLOCATOR_SNAPSHOTS`` to pickle paths (separated by ``os.pathsep``).
Checked on 2026-11-26 with four more, all equal: ``kkaitlyn111/cs336-a2-systems``
``cs336_systems/memory_logs/memory_ctx128_forward.pickle`` (178) and ``memory_files/memory_ctx128_fullstep.pickle``
(783), ``memory_files/memory_ctx256_fullstep_.pickle`` (791) @ c1272e18; ``Maphsge4/select_n`` ``snapshot.pickle``
@ 1f2f5480 (13). No public snapshot found uses several streams for its requests: that rule is checked by
hand-derived cases (tests/test_caching_allocator.py). Expandable segments are also checked by
:func:`expandable_snapshot`, written by hand from torch's ``try_allocate_expandable_block`` and ``map_block``, not
from the model, where each page mapped is known.
"""

import copy
import gzip
import json
import os
from collections import Counter
from pathlib import Path

import pytest

from memkit.memory import load_snapshot, replay_trace
from memkit.memory.trace_replay import recorded_alloc_conf

MiB = 1 << 20
PATHS = [p for p in os.environ.get("MEMKIT_ALLOCATOR_SNAPSHOTS", "").split(os.pathsep) if p]
CORPUS = json.loads(gzip.decompress((Path(__file__).parent / "data" / "allocator_traces.json.gz").read_bytes()))
IDS = [s["source"].split()[0] for s in CORPUS]


def segments_made(snapshot: dict, device: int = 0) -> list[int]:
    """The sizes of the segments the real allocator made during a device's trace, read from the trace itself."""
    return [e["size"] for e in snapshot["device_traces"][device] if e["action"] in ("segment_alloc", "segment_map")]


def traced(snapshot: dict) -> list[int]:
    return [d for d, trace in enumerate(snapshot["device_traces"]) if trace]


def check(snapshot: dict) -> None:
    replays = replay_trace(snapshot)
    assert list(replays) == traced(snapshot)
    for d, r in replays.items():
        real = segments_made(snapshot, d)
        assert r.reason is None
        assert [e.nbytes for e in r.events] == real and [e.model_bytes for e in r.events] == real
        assert r.same and r.matched == r.total == len(real)
        # and after the trace the model holds the segments the snapshot lists, older ones included
        assert Counter((s.pool, s.size, s.expandable) for s in r.model.segments) == Counter(
            (s["segment_type"], s["total_size"], bool(s.get("is_expandable")))
            for s in snapshot["segments"]
            if s["device"] == d
        )


@pytest.mark.parametrize("snapshot", CORPUS, ids=IDS)
def test_model_makes_the_segments_the_gpu_made(snapshot):
    check(snapshot)


def test_the_corpus_holds_plain_and_expandable_segments_several_gpus_and_older_segments():
    made = Counter(e["action"] for s in CORPUS for t in s["device_traces"] for e in t if "segment" in e["action"])
    assert set(made) == {"segment_alloc", "segment_free", "segment_map", "segment_unmap"}
    assert max(len(traced(s)) for s in CORPUS) == 3
    assert {r.start for s in CORPUS for r in replay_trace(s).values()} == {"empty", "reconstructed"}


@pytest.mark.skipif(not PATHS, reason="set MEMKIT_ALLOCATOR_SNAPSHOTS to snapshot pickles to replay")
@pytest.mark.parametrize("path", PATHS)
def test_model_makes_the_segments_of_snapshots_given_by_path(path):
    check(load_snapshot(path))


WITH_SEGMENTS = [s for s in CORPUS if segments_made(s)]
WITH_SEGMENTS_IDS = [s["source"].split()[0] for s in WITH_SEGMENTS]


def mutated(snapshot: dict, k: int = 2, by: int = 2 * MiB) -> tuple[dict, int]:
    """A copy of ``snapshot`` whose ``k``-th segment made on device 0 is ``by`` bytes larger, and that entry's
    trace index."""
    out = copy.deepcopy(snapshot)
    trace = out["device_traces"][0]
    index = [i for i, e in enumerate(trace) if e["action"] in ("segment_alloc", "segment_map")][k]
    trace[index]["size"] += by
    return out, index


@pytest.mark.parametrize("snapshot", WITH_SEGMENTS, ids=WITH_SEGMENTS_IDS)
def test_a_changed_segment_is_the_one_event_that_differs(snapshot):
    changed, index = mutated(snapshot)
    r = replay_trace(changed)[0]
    differ = [e for e in r.events if not e.same]
    assert [(e.index, e.nbytes - e.model_bytes) for e in differ] == [(index, 2 * MiB)]
    assert r.matched == r.total - 1 and not r.same


@pytest.mark.parametrize("traces", [[], [[]], [[], []]])
def test_a_snapshot_without_a_trace_says_replay_needs_record_memory_history(traces):
    snapshot = {"segments": CORPUS[0]["segments"], "device_traces": traces}
    with pytest.raises(ValueError, match=r"torch\.cuda\.memory\._record_memory_history\(\)"):
        replay_trace(snapshot)


def expandable_snapshot() -> dict:
    """A hand-written snapshot recorded under ``expandable_segments:True`` (torch >= 2.5 records the setting).

    Large pages are 20 MiB, small ones 2 MiB. 30 MiB: a new segment, ``map_block`` maps 2 pages (40 MiB) at once.
    15 MiB: the free 10 MiB tail is too small, but it is the candidate; one more page (20 MiB) is mapped after it.
    4 KiB: a new small segment, one 2 MiB page. 25 MiB after the 30 MiB block is freed: it fits, nothing is mapped.
    """
    big, small = 1 << 40, 1 << 41
    trace = [
        {"action": "segment_map", "addr": big, "size": 40 * MiB, "stream": 0},
        {"action": "alloc", "addr": big, "size": 30 * MiB, "stream": 0},
        {"action": "segment_map", "addr": big + 40 * MiB, "size": 20 * MiB, "stream": 0},
        {"action": "alloc", "addr": big + 30 * MiB, "size": 15 * MiB, "stream": 0},
        {"action": "segment_map", "addr": small, "size": 2 * MiB, "stream": 0},
        {"action": "alloc", "addr": small, "size": 4096, "stream": 0},
        {"action": "free_requested", "addr": big, "size": 30 * MiB, "stream": 0},
        {"action": "free_completed", "addr": big, "size": 30 * MiB, "stream": 0},
        {"action": "alloc", "addr": big, "size": 25 * MiB, "stream": 0},
    ]

    def segment(address, pool, *blocks):
        blocks = [{"size": n, "state": "active_allocated" if live else "inactive"} for n, live in blocks]
        size = sum(b["size"] for b in blocks)
        return {
            "device": 0,
            "address": address,
            "total_size": size,
            "stream": 0,
            "segment_type": pool,
            "blocks": blocks,
            "is_expandable": True,
        }

    large = segment(big, "large", (25 * MiB, True), (5 * MiB, False), (15 * MiB, True), (15 * MiB, False))
    segments = [large, segment(small, "small", (4096, True), (2 * MiB - 4096, False))]
    settings = {"PYTORCH_CUDA_ALLOC_CONF": "", "expandable_segments": True, "max_split_size": -1}
    return {"segments": segments, "device_traces": [trace], "allocator_settings": settings}


def test_expandable_segments_map_the_pages_torch_maps_at_the_same_alloc():
    snapshot = expandable_snapshot()
    r = replay_trace(snapshot)[0]
    assert r.start == "empty" and r.alloc_conf == "expandable_segments:True"
    rows = [(e.index, e.action, e.nbytes, e.model_action, e.model_bytes) for e in r.events]
    assert rows == [(i, "segment_map", n, "segment_map", n) for i, n in [(0, 40 * MiB), (2, 20 * MiB), (4, 2 * MiB)]]
    assert r.same and r.model.reserved_bytes == 62 * MiB
    # without the recorded setting the model makes plain segments, and says so
    plain = replay_trace(snapshot, alloc_conf="")[0]
    assert [(e.model_action, e.model_bytes) for e in plain.events] == [
        ("segment_alloc", 30 * MiB),  # a plain segment is the request rounded to 2 MiB
        ("segment_alloc", 16 * MiB),
        ("segment_alloc", 2 * MiB),
    ]
    assert plain.matched == 0 and not plain.same


def test_a_segment_only_the_model_made_is_listed_at_its_alloc():
    snapshot = expandable_snapshot()
    del snapshot["device_traces"][0][2]  # as if the real allocator had mapped nothing for the 15 MiB request
    snapshot["segments"][0]["total_size"] = 40 * MiB
    r = replay_trace(snapshot)[0]
    assert [(e.index, e.action, e.model_bytes) for e in r.events if not e.same] == [(2, None, 20 * MiB)]
    assert r.matched == r.total == 2 and not r.same


def test_recorded_alloc_conf_prefers_the_string_and_ignores_an_unset_max_split():
    assert recorded_alloc_conf({}) == ""
    assert recorded_alloc_conf({"allocator_settings": {"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:64"}}) == (
        "max_split_size_mb:64"
    )
    settings = {"PYTORCH_CUDA_ALLOC_CONF": "", "expandable_segments": False, "max_split_size": 128 * MiB}
    assert recorded_alloc_conf({"allocator_settings": settings}) == "max_split_size_mb:128"
    assert recorded_alloc_conf({"allocator_settings": {"max_split_size": -1}}) == ""


def test_a_start_the_segments_cannot_express_is_not_replayed_and_says_why():
    # older expandable pages: where they lie in their segment is unknown
    snapshot = expandable_snapshot()
    snapshot["device_traces"][0] = snapshot["device_traces"][0][4:]  # the large segment's maps fell off the trace
    r = replay_trace(snapshot)[0]
    assert r.start == "not replayed" and "expandable" in r.reason and r.model is None
    assert [(e.action, e.nbytes, e.model_bytes) for e in r.events] == [("segment_map", 2 * MiB, None)] and not r.same
    # a block freed by the trace that the segments no longer show: its size at the start is unknown
    trace = [{"action": "free_completed", "addr": 12345 << 20, "size": 4 * MiB, "stream": 0}]
    r = replay_trace({"segments": [], "device_traces": [trace + CORPUS[0]["device_traces"][0]]})[0]
    assert r.start == "not replayed" and f"{12345 << 20:#x}" in r.reason and r.total == len(segments_made(CORPUS[0]))


def test_pages_unmapped_by_empty_cache_are_mapped_again_with_the_next_in_one_alloc():
    # three 20 MiB blocks, one page each; the middle one freed and unmapped by empty_cache(), the last one freed;
    # 50 MiB: find_expandable_block starts at the unmapped middle page, map_block maps it (merging the free last
    # page), and the while loop maps one more page after them: two segment_map entries before one alloc
    base, K = 1 << 40, 20 * MiB

    def entry(action, k, size=K):
        return {"action": action, "addr": base + k * K, "size": size, "stream": 0}

    trace = [entry("segment_map", 0), entry("alloc", 0), entry("segment_map", 1), entry("alloc", 1)]
    trace += [entry("segment_map", 2), entry("alloc", 2), entry("free_requested", 1), entry("free_completed", 1)]
    trace += [entry("segment_unmap", 1), entry("free_requested", 2), entry("free_completed", 2)]
    trace += [entry("segment_map", 1), entry("segment_map", 3), entry("alloc", 1, 50 * MiB)]
    blocks = [{"size": 20 * MiB, "state": "active_allocated"}, {"size": 50 * MiB, "state": "active_allocated"}]
    blocks.append({"size": 10 * MiB, "state": "inactive"})
    segment = {
        "device": 0,
        "address": base,
        "total_size": 80 * MiB,
        "stream": 0,
        "segment_type": "large",
        "blocks": blocks,
        "is_expandable": True,
    }
    snapshot = {"segments": [segment], "device_traces": [trace], "allocator_settings": {"expandable_segments": True}}
    r = replay_trace(snapshot)[0]
    assert [(e.index, e.model_bytes) for e in r.events] == [(0, K), (2, K), (4, K), (11, K), (12, K)]
    assert r.same and r.model.reserved_bytes == 80 * MiB


def test_older_small_segments_are_rebuilt_block_for_block():
    # two 2 MiB small segments older than the trace, each with one block live and a free tail over 1 MiB (so the
    # rebuild takes the tail in pieces of at most 1 MiB); the trace fills both tails exactly, frees the fillers,
    # then needs a new segment for 4 KiB: only a rebuild that leaves no gap in the first segment sees it alike
    a, b, c, K = 1 << 30, (1 << 30) + 2 * MiB, 1 << 31, 1024

    def entry(action, addr, size):
        return {"action": action, "addr": addr, "size": size, "stream": 0}

    fill = [(a + 512 * K, MiB), (a + 1536 * K, 512 * K), (b + 4 * K, MiB), (b + 4 * K + MiB, MiB - 4 * K)]
    trace = [entry("alloc", *f) for f in fill] + [entry("segment_alloc", c, 2 * MiB), entry("alloc", c, 4 * K)]
    trace += [entry("free_completed", *f) for f in fill]

    def segment(address, live):
        blocks = [{"size": live, "state": "active_allocated"}, {"size": 2 * MiB - live, "state": "inactive"}]
        return dict(device=0, address=address, total_size=2 * MiB, stream=0, segment_type="small", blocks=blocks)

    snapshot = {"segments": [segment(a, 512 * K), segment(b, 4 * K), segment(c, 4 * K)], "device_traces": [trace]}
    r = replay_trace(snapshot)[0]
    assert r.start == "reconstructed" and r.older_segments == 2
    assert [(e.index, e.nbytes, e.model_bytes) for e in r.events] == [(4, 2 * MiB, 2 * MiB)] and r.same


def test_a_rebuild_that_makes_other_segments_than_the_snapshot_is_not_replayed():
    # a 30 MiB segment cannot come from roundup_power2_divisions:4 (30 MiB rounds up to 32): the conf is not the
    # one the snapshot was recorded under, and the replay says so instead of comparing
    blocks = [{"size": 30 * MiB, "state": "inactive"}]
    older = dict(device=0, address=1 << 30, total_size=30 * MiB, stream=0, segment_type="large", blocks=blocks)
    trace = [{"action": "segment_alloc", "addr": 1 << 31, "size": 2 * MiB, "stream": 0}]
    trace.append({"action": "alloc", "addr": 1 << 31, "size": 4096, "stream": 0})
    snapshot = {"segments": [older], "device_traces": [trace]}
    assert replay_trace(snapshot)[0].same
    r = replay_trace(snapshot, alloc_conf="roundup_power2_divisions:4")[0]
    assert r.start == "not replayed" and "made other segments than the snapshot holds" in r.reason
    assert f"('large', {32 * MiB}, 0): 1" in r.reason and f"('large', {30 * MiB}, 0): 1" in r.reason
