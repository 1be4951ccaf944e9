"""Timeline behaviours that mutation testing (``python -m bench.mutation timeline``) found unchecked: a tracked
timeline follows its block live and is fixed after it, the baseline split across devices, the column dtypes of
``events.COLUMNS``, and what errors and unknown names read as. Each test states a documented behaviour."""

import pytest
import torch

import memkit
from memkit.memory import CATEGORIES, PHASES, Timeline
from memkit.memory.events import ALLOC, COLUMNS, FREE

ACT, TMP = CATEGORIES.index("activation"), CATEGORIES.index("temporary")
FWD = PHASES.index("forward")


def columns(rows):
    """Rows of (time, action, bytes, category, phase, device, op, frame, storage) as plain Python lists."""
    return {name: [r[i] for r in rows] for i, (name, _) in enumerate(COLUMNS)}


# Two devices: cuda:0 rises to 300 (the sum peaks at 300 + 200 = 500 at event 2), cuda:1 to 400 later alone.
TWO = [
    (0.0, ALLOC, 300, ACT, FWD, 0, -1, -1, 1),
    (0.1, ALLOC, 200, ACT, FWD, 1, -1, -1, 2),
    (0.2, FREE, 300, ACT, FWD, 0, -1, -1, 1),
    (0.3, ALLOC, 200, TMP, FWD, 1, -1, -1, 3),
]
SPLIT = {"cuda:0": {"parameter": 1000, "input": 10}, "cuda:1": {"parameter": 4000}}


def two_devices(**kwargs):
    return Timeline(columns(TWO), devices=["cuda:0", "cuda:1"], **kwargs)


# ---- a tracked timeline is live inside its block, fixed after it ----------------------------------------------


def test_a_tracked_timeline_follows_its_block_live_then_stays_fixed():
    x = torch.ones(256)
    with memkit.track(inputs=x, record_stacks=True) as tl:
        assert (tl.devices, tl.ops, tl.frames) == ([], [], [])
        assert len(tl) == 0 and tl.baseline_by_category["input"] == x.nbytes
        y = x * 2
        n = len(tl)
        assert n >= 1 and tl.peak_bytes >= x.nbytes + y.nbytes
        assert tl.devices == ["cpu"] and "aten.mul.Tensor" in tl.ops
        assert any(__file__.rsplit("/", 1)[-1] in f for f in tl.frames)  # record_stacks: this line's stack
        del y
        assert len(tl) > n and tl.end_bytes == x.nbytes
        assert tl.baseline_bytes == x.nbytes
    frozen = len(tl), tl.peak_bytes
    z = x * 3  # after the block: the timeline no longer changes
    assert (len(tl), tl.peak_bytes) == frozen and z.nbytes


# ---- the baseline across devices ------------------------------------------------------------------------------


def test_baseline_by_device_alone_gives_the_baseline_by_category():
    tl = two_devices(baseline_by_device=SPLIT)
    assert tl.baseline_by_category == dict.fromkeys(CATEGORIES, 0) | {"parameter": 5000, "input": 10}
    assert tl.baseline_by_device == {"cuda:0": 1010, "cuda:1": 4000}
    assert tl.on_device("cuda:0").baseline_by_category == dict.fromkeys(CATEGORIES, 0) | SPLIT["cuda:0"]
    assert tl.peak_by_device() == {"cuda:0": 1310, "cuda:1": 4400}
    assert tl.peak_bytes == 5010 + 500  # the sum at one moment, which no single device held


def test_a_split_that_disagrees_with_the_baseline_by_category_is_refused():
    with pytest.raises(ValueError, match="baseline_by_device sums to 5000 bytes of 'parameter'"):
        two_devices(baseline_by_device=SPLIT, baseline_by_category={"parameter": 4999, "input": 10})
    assert two_devices(baseline_by_device=SPLIT, baseline_by_category={"parameter": 5000, "input": 10})


def test_one_device_knows_its_own_baseline():
    rows = [r[:5] + (0,) + r[6:] for r in TWO]
    tl = Timeline(columns(rows), devices=["cpu"], baseline_by_category={"input": 10})
    assert tl.baseline_by_device == {"cpu": 10}
    assert tl.on_device("cpu").peak_bytes == tl.peak_bytes
    assert "peak_by_device" not in tl.summary()  # one device: peak_bytes is already its peak


def test_several_devices_without_a_baseline_start_each_from_zero():
    tl = two_devices()
    assert tl.baseline_by_device == {"cuda:0": 0, "cuda:1": 0}
    assert tl.on_device("cuda:1").peak_by_category() == dict.fromkeys(CATEGORIES, 0) | {
        "activation": 200,
        "temporary": 200,
    }
    assert tl.peak_by_device() == {"cuda:0": 300, "cuda:1": 400}


def test_several_devices_sharing_an_unknown_baseline_cannot_be_told_apart():
    tl = two_devices(baseline_by_category={"parameter": 64})
    assert tl.baseline_by_device is None
    with pytest.raises(ValueError, match="split between them is unknown"):
        tl.on_device("cuda:0")
    assert "peak_by_device" not in tl.summary()


def test_summary_of_several_devices_gives_each_devices_peak():
    tl = two_devices(baseline_by_device=SPLIT)
    summary = tl.summary()
    assert summary["peak_by_device"] == {"cuda:0": 1310, "cuda:1": 4400}
    assert summary["peak_bytes"] == tl.peak_bytes


# ---- columns, errors, unknown names ---------------------------------------------------------------------------


def test_columns_given_as_lists_get_the_schemas_dtypes():
    tl = two_devices()
    for name, dtype in COLUMNS:
        assert tl.column(name).dtype == dtype, name
    cols = columns(TWO)
    del cols["op"], cols["frame"]
    tl = Timeline(cols, devices=["cuda:0", "cuda:1"])
    assert tl.column("op").dtype == dict(COLUMNS)["op"] and tl.column("frame").dtype == dict(COLUMNS)["frame"]


def test_a_bad_code_is_named_with_the_allowed_range():
    cols = columns(TWO)
    cols["category"] = [0, 0, 99, 0]
    expected = f"column 'category' holds code 99; codes must be 0..{len(CATEGORIES) - 1} ({CATEGORIES})"
    with pytest.raises(ValueError) as info:
        Timeline(cols)
    assert str(info.value) == expected


def test_an_index_out_of_range_names_the_allowed_range():
    tl = two_devices()
    with pytest.raises(IndexError) as info:
        tl.top_allocations(at=len(TWO))
    assert str(info.value) == f"at must be in [-1, {len(TWO) - 1}], got {len(TWO)}"


def test_allocations_without_device_names_read_as_unknown_and_frame_zero_is_a_frame():
    rows = [(0.0, ALLOC, 64, ACT, FWD, 0, -1, 0, 1)]
    tl = Timeline(columns(rows), frames=["model.py:3 forward"])
    (top,) = tl.top_allocations()
    assert top["device"] == "?" and top["frame"] == "model.py:3 forward" and top["op"] is None
    assert tl.to_pandas()["device"].tolist() == ["?"]


# ---- one device's events alone ---------------------------------------------------------------------------------


def test_a_split_naming_a_device_the_timeline_lacks_is_refused():
    with pytest.raises(ValueError) as info:
        two_devices(baseline_by_device={"cuda:7": {"parameter": 1}}, baseline_by_category={"parameter": 1})
    assert str(info.value) == "baseline_by_device names devices ['cuda:7'] that are not in devices ['cuda:0', 'cuda:1']"


def test_a_split_with_an_unknown_category_is_refused():
    with pytest.raises(ValueError) as info:
        two_devices(baseline_by_device={"cuda:1": {"weights": 1}})
    assert str(info.value) == "baseline_by_device['cuda:1'] has unknown categories ['weights']"


def test_a_device_left_out_of_the_split_starts_from_zero():
    tl = two_devices(baseline_by_device={"cuda:1": {"parameter": 8}})
    assert tl.baseline_by_device == {"cuda:0": 0, "cuda:1": 8}


def test_an_unknown_device_is_named():
    with pytest.raises(KeyError, match=r"no device 'cuda:9'; devices: \['cuda:0', 'cuda:1'\]"):
        two_devices().on_device("cuda:9")


def test_an_unknown_split_says_how_to_give_it():
    with pytest.raises(ValueError) as info:
        two_devices(baseline_by_category={"parameter": 2048}).on_device("cuda:0")
    assert str(info.value) == (
        "this timeline's baseline (2.00 KiB) spans devices ['cuda:0', 'cuda:1'] and its split between them is "
        "unknown, so one device's memory cannot be told apart (give Timeline(baseline_by_device=...))"
    )


def test_one_devices_timeline_keeps_names_times_ops_frames_and_label():
    rows = [(0.0, ALLOC, 64, ACT, FWD, 0, -1, -1, 1), (0.5, ALLOC, 128, TMP, FWD, 1, 1, 0, 2)]
    tl = Timeline(
        columns(rows),
        devices=["cuda:0", "cuda:1"],
        ops=["aten.mm.default", "aten.add.Tensor"],
        frames=["model.py:3 forward"],
        meta={"label": "step"},
    )
    sub = tl.on_device("cuda:1")
    assert len(sub) == 1 and sub.devices == ["cuda:1"]
    assert sub.ops == tl.ops and sub.frames == tl.frames
    assert sub.top_allocations() == [
        {
            "index": 0,  # the sub-timeline's own event index
            "bytes": 128,
            "category": "temporary",
            "phase": "forward",
            "time": 0.5,
            "device": "cuda:1",
            "op": "aten.add.Tensor",
            "frame": "model.py:3 forward",
        }
    ]
    assert sub.meta == {"label": "step", "device": "cuda:1"}
    assert repr(sub).startswith("Timeline('step', events=1,")


# ---- snapshots: written and read back -------------------------------------------------------------------------


def test_a_timeline_written_as_a_snapshot_reads_back_with_its_bytes_and_categories(tmp_path):
    tl = two_devices(baseline_by_device=SPLIT)
    path = tmp_path / "step.pickle"
    data = tl.to_snapshot(path)
    assert isinstance(data, dict) and path.is_file()
    assert path.read_bytes()[:2] == b"\x80\x04"  # pickle protocol 4, the newest memory_viz reads
    for source in (data, path):
        back = Timeline.from_snapshot(source, default_category="temporary")
        assert back.peak_bytes == tl.peak_bytes and back.end_bytes == tl.end_bytes
        assert back.peak_by_category() == tl.peak_by_category()
        assert back.peak_by_device() == tl.peak_by_device()


def test_from_snapshot_passes_its_keyword_arguments_to_the_reader():
    trace = [{"action": "alloc", "addr": 0x7F0000000000, "size": 1000, "stream": 0, "time_us": 1}]
    tl = Timeline.from_snapshot({"segments": [], "device_traces": [trace]}, default_category="activation")
    assert tl.peak_by_category()["activation"] == 1000


def test_top_allocations_gives_ten_by_default_biggest_first():
    rows = [(i / 10, ALLOC, 100 + i, ACT, FWD, 0, -1, -1, i) for i in range(12)]
    top = Timeline(columns(rows), devices=["cpu"]).top_allocations()
    assert [a["bytes"] for a in top] == [111 - i for i in range(10)]


def test_written_segments_have_torchs_shape_and_are_tiled_by_their_blocks():
    # torch.cuda.memory._snapshot's Segment and Block (its docstring), as a real GPU writes them
    rows = [
        (0.0, ALLOC, 1000, ACT, FWD, 0, -1, -1, 1),
        (0.1, ALLOC, 3000, ACT, FWD, 0, -1, -1, 2),
        (0.2, FREE, 1000, ACT, FWD, 0, -1, -1, 1),  # a gap before the block still live at the end
    ]
    data = Timeline(columns(rows), devices=["cuda:0"]).to_snapshot()
    (segment,) = data["segments"]
    assert set(segment) == {
        "device",
        "address",
        "total_size",
        "allocated_size",
        "active_size",
        "requested_size",
        "stream",
        "segment_type",
        "segment_pool_id",
        "is_expandable",
        "frames",
        "blocks",
    }
    assert segment["stream"] == 0 and all(e["stream"] == 0 for e in data["device_traces"][0])  # one stream
    assert (segment["segment_type"], segment["segment_pool_id"]) == ("large", (0, 0))  # the default pool
    assert segment["is_expandable"] is False and segment["frames"] == []
    blocks = segment["blocks"]
    live = [b for b in blocks if b["state"] == "active_allocated"]
    assert [b["requested_size"] for b in live] == [3000]
    assert segment["allocated_size"] == segment["active_size"] == sum(b["size"] for b in live)
    assert segment["requested_size"] == 3000
    assert {b["state"] for b in blocks} == {"active_allocated", "inactive"}
    address = segment["address"]
    for block in blocks:  # the blocks tile the segment from its address, gaps included
        assert set(block) >= {"address", "size", "requested_size", "state", "frames"} and block["address"] == address
        address += block["size"]
    assert address == segment["address"] + segment["total_size"]
