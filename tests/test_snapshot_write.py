"""What :func:`write_snapshot` writes: torch's snapshot schema (the keys and values torch's allocator writes, which
``torch.cuda._memory_viz`` and pytorch.org/memory_viz read), the allocator's address reuse, each device's own
address range, the baseline on the right device, and a file that the reader and the viz can open.
"""

import pickle
import time

import numpy as np
import pytest
from torch.cuda import _memory_viz

from memkit.memory import CATEGORIES, PHASES, Timeline
from memkit.memory.events import ALLOC, CUDA_BLOCK, FREE, round_alloc
from memkit.memory.snapshot import read_snapshot
from memkit.memory.snapshot_write import write_snapshot

MiB = 1 << 20
SEGMENT = 2 * MiB
# what torch's allocator writes per segment and block (torch/csrc/cuda/memory_snapshot.cpp, torch >= 2.1)
SEGMENT_KEYS = {
    "device", "address", "total_size", "allocated_size", "active_size", "requested_size", "stream", "segment_type",
    "segment_pool_id", "is_expandable", "frames", "blocks",
}  # fmt: skip
BLOCK_KEYS = {"address", "size", "requested_size", "state", "frames"}
BLOCK_STATES = {"active_allocated", "active_pending_free", "active_awaiting_free", "inactive"}
CAT = {c: i for i, c in enumerate(CATEGORIES)}
OTHER = PHASES.index("other")


def timeline(rows, **kwargs):
    """rows: (time, action, bytes, category name, device index, storage key[, op, frame])."""
    cols = {name: [] for name in ("time", "action", "bytes", "category", "phase", "device", "op", "frame", "storage")}
    for t, action, nbytes, category, device, key, *rest in rows:
        op, frame = rest or (-1, -1)
        for name, value in zip(cols, (t, action, nbytes, CAT[category], OTHER, device, op, frame, key), strict=True):
            cols[name].append(value)
    return Timeline(cols, **kwargs)


def live_blocks(data, device=0):
    return [b for s in data["segments"] if s["device"] == device for b in s["blocks"] if b["state"] != "inactive"]


def test_segments_and_blocks_are_written_as_torchs_allocator_writes_them():
    tl = timeline(
        [
            (0.0, ALLOC, 1000, "activation", 0, 1),
            (0.1, ALLOC, 3000, "activation", 0, 2),
            (0.2, ALLOC, 700, "temporary", 0, 3),
            (0.3, FREE, 3000, "activation", 0, 2),  # leaves a gap between 1 and 3
        ],
        devices=["cuda:0"],
        baseline_by_category={"parameter": 5000},  # and every other category 0: no block for those
    )
    data = write_snapshot(tl)
    (seg,) = data["segments"]
    assert set(seg) == SEGMENT_KEYS
    assert seg["segment_type"] == "large" and seg["total_size"] == SEGMENT  # one 2 MiB segment holds it all
    assert seg["segment_pool_id"] == (0, 0)  # the default pool, not a CUDA graph's private one
    assert seg["is_expandable"] is False and seg["stream"] == 0 and seg["frames"] == []
    blocks = seg["blocks"]
    assert all(set(b) == BLOCK_KEYS and b["state"] in BLOCK_STATES and b["size"] > 0 for b in blocks)
    live = [b for b in blocks if b["state"] == "active_allocated"]
    assert sorted(b["requested_size"] for b in live) == [700, 1000, 5000]  # the two live tensors and the baseline
    assert all(b["size"] == round_alloc(b["requested_size"], CUDA_BLOCK) for b in live)
    assert all(b["requested_size"] == 0 for b in blocks if b["state"] == "inactive")
    assert seg["allocated_size"] == seg["active_size"] == sum(b["size"] for b in live)
    assert seg["requested_size"] == sum(b["requested_size"] for b in blocks) == 6700
    gaps = [b["size"] for b in blocks if b["state"] == "inactive"]
    assert gaps[0] == round_alloc(3000, CUDA_BLOCK) and sum(gaps) == SEGMENT - seg["allocated_size"]

    summary = _memory_viz.segsum(data)
    assert "segments: 1" in summary and "total_reserved: 2.0MiB" in summary
    back = read_snapshot(data)
    info = back.meta["segments"]["cuda:0"]
    assert (info["segments"], info["expandable_segments"], info["reserved_bytes"]) == (1, 0, SEGMENT)
    assert info["blocks"]["inactive"] == {"count": len(gaps), "bytes": sum(gaps)}
    assert info["largest_inactive_block"] == max(gaps)
    assert back.meta["allocated_bytes"] == {"cuda:0": seg["allocated_size"]}
    assert back.baseline_by_category == tl.baseline_by_category and back.end_bytes == tl.end_bytes == 6700


def test_freed_blocks_are_reused_so_the_segment_stays_the_size_of_the_peak():
    rows = []
    for k in range(6):  # 1.5 MiB allocated and freed six times: one block, reused
        rows += [(k, ALLOC, 3 * MiB // 2, "temporary", 0, k), (k + 0.5, FREE, 3 * MiB // 2, "temporary", 0, k)]
    data = write_snapshot(timeline(rows, devices=["cuda:0"]))
    allocs = [e["addr"] for e in data["device_traces"][0] if e["action"] == "alloc"]
    assert len(set(allocs)) == 1
    assert [s["total_size"] for s in data["segments"]] == [SEGMENT]
    assert read_snapshot(data).meta["reserved_bytes"] == {"cuda:0": SEGMENT}


def test_each_device_has_its_own_address_range():
    # CUDA's unified address space: no address is on two devices
    rows = [(0.0, ALLOC, 4096, "activation", 0, 1), (0.1, ALLOC, 4096, "activation", 1, 2)]
    rows += [(0.2, ALLOC, 512, "activation", 1, 3), (0.3, FREE, 4096, "activation", 0, 1)]
    data = write_snapshot(timeline(rows, devices=["cuda:0", "cuda:1"]))
    ranges = sorted((s["address"], s["address"] + s["total_size"]) for s in data["segments"])
    assert len(ranges) == 2 and ranges[0][1] <= ranges[1][0]
    addrs = [{e["addr"] for e in trace if e["action"] == "alloc"} for trace in data["device_traces"]]
    assert not addrs[0] & addrs[1]
    for trace in data["device_traces"]:
        seg = next(s for s in data["segments"] if s["device"] == data["device_traces"].index(trace))
        assert all(seg["address"] <= e["addr"] < seg["address"] + seg["total_size"] for e in trace if e["addr"])


def test_a_file_is_pickle_protocol_4_that_the_reader_opens(tmp_path):
    tl = timeline([(0.0, ALLOC, 100, "activation", 0, 1)], devices=["cuda:0"])
    path = tmp_path / "s.pickle"
    data = write_snapshot(tl, path)
    raw = path.read_bytes()
    assert raw[:2] == b"\x80\x04"  # protocol 4: MemoryViz.js reads no newer one
    assert pickle.loads(raw) == data and read_snapshot(path).column("bytes").tolist() == [100]


def test_meta_that_is_not_plain_data_is_left_out_so_the_file_stays_safe_to_read(tmp_path):
    tl = timeline([(0.0, ALLOC, 100, "activation", 0, 1)], devices=["cuda:0"])
    tl.meta.update(label="run 3", steps=2, scale=np.float64(0.5), shape=np.arange(3), none=None)
    path = tmp_path / "s.pickle"
    data = write_snapshot(tl, path)
    assert data["memkit"]["meta"] == {"label": "run 3", "steps": 2, "none": None}
    back = read_snapshot(path)  # a numpy value would need a global, which the reader refuses
    assert back.meta["label"] == "run 3" and "scale" not in back.meta and "shape" not in back.meta


def test_a_timeline_without_device_names_is_written_as_cuda_0():
    cols = {"time": [0.0], "action": [ALLOC], "bytes": [64], "category": [CAT["activation"]], "phase": [0]}
    cols |= {"device": [0], "storage": [1]}
    data = write_snapshot(Timeline(cols))
    assert data["memkit"]["devices"] == {0: "cuda:0"}
    assert [s["device"] for s in data["segments"]] == [0]
    assert read_snapshot(data).devices == ["cuda:0"]


def test_times_are_wall_clock_microseconds_as_torch_records_them():
    tl = timeline([(0.0, ALLOC, 64, "activation", 0, 1), (2.5, FREE, 64, "activation", 0, 1)], devices=["cuda:0"])
    before = time.time() * 1e6
    data = write_snapshot(tl)
    after = time.time() * 1e6
    times = [e["time_us"] for e in data["device_traces"][0]]
    assert before - 1 <= times[0] <= after + 1
    assert times[1] - times[0] == 2_500_000
    assert data["memkit"]["time_zero_us"] == times[0]


def test_many_entries_from_one_site_share_their_stack_so_the_file_stays_small():
    n = 2000
    rows = [(i * 1e-3, ALLOC, 512, "activation", 0, i, 0, 0) for i in range(n)]
    frames = ["\n".join(f"/src/model/layer{k}.py:{k} forward" for k in range(8))]
    tl = timeline(rows, devices=["cuda:0"], ops=["aten.mm.default"], frames=frames)
    raw = pickle.dumps(write_snapshot(tl), protocol=4)
    assert len(raw) < 150 * n  # ~100 B an entry (and its block); a stack per entry would take ~300 B more
    assert read_snapshot(raw).frames == frames


def test_an_op_or_frame_code_outside_its_table_is_written_without_one():
    rows = [(0.0, ALLOC, 64, "activation", 0, 1, 1, 1), (0.1, ALLOC, 64, "activation", 0, 2, 0, 0)]
    tl = timeline(rows, devices=["cuda:0"], ops=["aten.mm.default"], frames=["/src/m.py:3 forward"])
    back = read_snapshot(write_snapshot(tl))
    assert [back.ops[o] if o >= 0 else None for o in back.column("op")] == [None, "aten.mm.default"]
    assert [back.frames[f] if f >= 0 else None for f in back.column("frame")] == [None, "/src/m.py:3 forward"]


def test_baseline_blocks_carry_their_category_and_no_op_or_site():
    rows = [(0.0, ALLOC, 64, "activation", 0, 1, 1, 1)]
    tl = timeline(rows, devices=["cuda:0"], ops=["aten.mm", "aten.add"], frames=["/a.py:1 f", "/b.py:2 g"],
                  baseline_by_category={"parameter": 4096, "optimizer_state": 1024})  # fmt: skip
    data = write_snapshot(tl)
    baseline = [b for b in live_blocks(data) if b["requested_size"] != 64]
    assert sorted(b["frames"][0]["name"] for b in baseline) == [
        "category=optimizer_state phase=other",
        "category=parameter phase=other",
    ]
    assert all(len(b["frames"]) == 1 for b in baseline)  # the marker alone: no frame text


def test_the_baseline_of_several_devices_without_a_split_goes_where_the_window_begins():
    rows = [(0.0, ALLOC, 512, "activation", 1, 1), (0.1, ALLOC, 512, "activation", 0, 2)]
    tl = timeline(rows, devices=["cuda:0", "cuda:1"], baseline_by_category={"parameter": 8192})
    assert tl.baseline_by_device is None  # the split is unknown
    data = write_snapshot(tl)
    assert sum(b["requested_size"] for b in live_blocks(data, 1)) == 8192 + 512
    assert read_snapshot(data).baseline_by_device == {"cuda:0": 0, "cuda:1": 8192}
    # without any event: on the first device
    empty = write_snapshot(Timeline(devices=["cuda:0"], baseline_by_category={"parameter": 4096}))
    assert read_snapshot(empty).baseline_by_device == {"cuda:0": 4096}
    empty = write_snapshot(Timeline(devices=["cuda:0", "cuda:1"], baseline_by_category={"parameter": 4096}))
    assert [s["device"] for s in empty["segments"]] == [0]


def test_pre_window_storages_freed_on_a_device_come_off_that_devices_baseline():
    # a 1 KiB parameter of cuda:1 from before the window, freed in it; cuda:0 holds the larger baseline
    rows = [(0.0, FREE, 1024, "parameter", 1, 7), (0.1, ALLOC, 512, "activation", 0, 8)]
    split = {"cuda:0": {"parameter": 4096}, "cuda:1": {"parameter": 1024, "buffer": 512}}
    tl = timeline(rows, devices=["cuda:0", "cuda:1"], baseline_by_device=split)
    data = write_snapshot(tl)
    assert sorted(b["requested_size"] for b in live_blocks(data, 0)) == [512, 4096]
    assert sorted(b["requested_size"] for b in live_blocks(data, 1)) == [512]  # the buffer; the parameter is freed
    back = read_snapshot(data)
    assert back.baseline_by_device == tl.baseline_by_device == {"cuda:0": 4096, "cuda:1": 1536}
    assert back.peak_by_device() == tl.peak_by_device()
    assert "unaccounted_bytes" not in back.meta


def test_refusals_name_what_is_wrong():
    with pytest.raises(TypeError, match="got dict"):
        write_snapshot({"segments": []})
    tl = timeline([(0.0, FREE, 10, "parameter", 0, 5)], devices=["cpu"], baseline_by_category={"parameter": 4})
    with pytest.raises(ValueError, match=r"\{\(0, 'parameter'\): 6\}"):  # 6 bytes more than the baseline holds
        write_snapshot(tl)


def test_each_devices_trace_ends_with_torchs_snapshot_entry_at_the_last_events_time():
    rows = [(0.0, ALLOC, 64, "activation", 0, 1), (1.25, ALLOC, 64, "activation", 1, 2)]
    rows += [(2.5, FREE, 64, "activation", 0, 1)]
    data = write_snapshot(timeline(rows, devices=["cuda:0", "cuda:1"]))
    zero = data["memkit"]["time_zero_us"]
    for trace in data["device_traces"]:
        *events, last = trace
        assert all(e["action"] != "snapshot" for e in events)
        # what the allocator records when a snapshot is taken: no address, no size, no stack
        assert last == {
            "action": "snapshot",
            "addr": 0,
            "size": 0,
            "stream": 0,
            "time_us": zero + 2_500_000,  # the timeline's last event, on every device
            "frames": [],
            "category": "unknown",  # MemoryViz.js needs this category to exist
        }
    # a device without any event has an empty trace, no snapshot entry
    data = write_snapshot(timeline([(0.5, ALLOC, 64, "activation", 1, 1)], devices=["cuda:0", "cuda:1"]))
    assert data["device_traces"][0] == [] and data["device_traces"][1][-1]["action"] == "snapshot"


def test_allocator_settings_and_external_annotations_come_from_meta_or_are_empty():
    rows = [(0.0, ALLOC, 64, "activation", 0, 1)]
    data = write_snapshot(timeline(rows, devices=["cuda:0"]))
    assert data["allocator_settings"] == {} and data["external_annotations"] == []
    settings = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    notes = [{"device": 0, "stage": "START", "name": "fwd", "time_us": 5}]
    tl = timeline(rows, devices=["cuda:0"], meta={"allocator_settings": settings, "external_annotations": notes})
    data = write_snapshot(tl)
    assert data["allocator_settings"] == settings and data["external_annotations"] == notes
