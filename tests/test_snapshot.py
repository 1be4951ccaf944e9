"""CUDA memory snapshots: read in torch's exact schema, written so torch's own viz accepts them, loaded safely."""

import builtins
import io
import os
import pickle
import pickletools
import random
import re
import types

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.cuda import _memory_viz

import memkit
from memkit.memory import CATEGORIES, PHASES, Timeline
from memkit.memory.cuda import CudaHistoryError, cuda_history_available, cuda_snapshot, record_cuda_history
from memkit.memory.events import ALLOC, COLUMNS, CUDA_BLOCK, FREE, round_alloc
from memkit.memory.snapshot import _MAX_DEVICES, STACK_FRAMES, SnapshotError, load_snapshot, read_snapshot
from memkit.memory.snapshot_write import write_snapshot

# ---- fixtures in torch's schema ------------------------------------------------------------------------------


def entry(action, addr, size, time_us, frames=None, **extra):
    e = {"action": action, "addr": addr, "size": size, "stream": 0, "time_us": time_us, **extra}
    if frames is not None:
        e["frames"] = frames
    return e


def segment(device, address, blocks, total_size=None):
    """A segment the way torch writes it: blocks tile it from ``address``, each with its own address."""
    out, addr = [], address
    for size, requested, state in blocks:
        out.append({"address": addr, "size": size, "requested_size": requested, "state": state, "frames": []})
        addr += size
    total = total_size or addr - address
    allocated = sum(b["size"] for b in out if b["state"] == "active_allocated")
    return {
        "device": device,
        "address": address,
        "total_size": total,
        "allocated_size": allocated,
        "active_size": sum(b["size"] for b in out if b["state"] != "inactive"),
        "requested_size": sum(b["requested_size"] for b in out if b["state"] == "active_allocated"),
        "stream": 0,
        "segment_type": "large",
        "segment_pool_id": (0, 0),
        "is_expandable": False,
        "frames": [],
        "blocks": out,
    }


BASE = 0x7F00_0000_0000


def hand_snapshot():
    """A pre-trace block P (live at the end), a pre-trace block Q (freed in the trace), and A, B, C in the trace.

    A is freed with a request before C is allocated and completed after: the viz (and we) count it until then.
    """
    P, Q, A, B, C = (BASE + k * 0x1000 for k in range(5))
    trace = [
        entry("segment_alloc", BASE, 0x5000, 90),
        entry("alloc", A, 1000, 100),
        entry("free_requested", Q, 300, 120),
        entry("free_completed", Q, 300, 120),
        entry("alloc", B, 2000, 150),
        entry("free_requested", A, 1000, 200),
        entry("alloc", C, 500, 250),
        entry("free_completed", A, 1000, 300),
        entry("snapshot", 0, 0, 310),
    ]
    seg = segment(
        0,
        BASE,
        [
            (0x1000, 4000, "active_allocated"),  # P, from before the trace
            (0x1000, 0, "inactive"),  # Q, freed
            (0x1000, 0, "inactive"),  # A, freed
            (0x1000, 2000, "active_allocated"),  # B
            (0x1000, 500, "active_allocated"),  # C
        ],
    )
    return {"segments": [seg], "device_traces": [trace], "allocator_settings": {}, "external_annotations": []}


def test_hand_built_snapshot_counts_until_free_completed_and_reconstructs_the_baseline():
    tl = read_snapshot(hand_snapshot())
    assert tl.devices == ["cuda:0"]
    assert tl.baseline_by_category == {**dict.fromkeys(CATEGORIES, 0), "unknown": 4000 + 300}  # nothing guessed
    assert tl.column("action").tolist() == [ALLOC, FREE, ALLOC, ALLOC, FREE]
    assert tl.column("bytes").tolist() == [1000, 300, 2000, 500, 1000]
    assert tl.live_bytes.tolist() == [5300, 5000, 7000, 7500, 6500]
    assert tl.peak_bytes == 7500  # A is still counted when C arrives: its free was only requested
    assert tl.end_bytes == 4000 + 2000 + 500  # what the segments hold
    np.testing.assert_allclose(tl.time, [0, 20e-6, 50e-6, 150e-6, 200e-6])
    assert tl.column("storage")[0] == BASE + 2 * 0x1000
    assert set(tl.column("phase").tolist()) == {PHASES.index("other")}
    assert tl.meta["reserved_bytes"] == {"cuda:0": 0x5000}
    assert tl.meta["allocated_bytes"] == {"cuda:0": 3 * 0x1000}
    assert tl.meta["free_action"] == {"cuda:0": "free_completed"}
    assert "unaccounted_bytes" not in tl.meta


def test_a_trace_without_free_completed_frees_at_the_requests():
    data = hand_snapshot()
    data["device_traces"][0] = [e for e in data["device_traces"][0] if e["action"] != "free_completed"]
    tl = read_snapshot(data)
    assert tl.meta["free_action"] == {"cuda:0": "free_requested"}
    assert tl.live_bytes.tolist() == [5300, 5000, 7000, 6000, 6500]
    assert tl.end_bytes == 6500


def test_default_category_granularity_and_device_names():
    tl = read_snapshot(hand_snapshot(), default_category="parameter", alloc_granularity=512, device_names=["gpu0"])
    assert tl.devices == ["gpu0"]
    assert tl.baseline_by_category["parameter"] == 4096 + 512
    assert tl.column("bytes").tolist() == [1024, 512, 2048, 512, 1024]
    assert tl.end_bytes == 4096 + 2048 + 512
    with pytest.raises(ValueError, match="category must be one of"):
        read_snapshot(hand_snapshot(), default_category="weights")
    with pytest.raises(ValueError, match="alloc_granularity"):
        read_snapshot(hand_snapshot(), alloc_granularity=0)


def test_two_devices_are_merged_in_time_order():
    d0 = [entry("alloc", BASE, 100, 10), entry("free_requested", BASE, 100, 40), entry("free_completed", BASE, 100, 40)]
    d1 = [entry("alloc", BASE, 7, 20), entry("alloc", BASE + 512, 9, 30)]
    data = {"segments": [segment(1, BASE, [(512, 7, "active_allocated"), (512, 9, "active_allocated")])]}
    data["device_traces"] = [d0, d1]
    tl = read_snapshot(data)
    assert tl.devices == ["cuda:0", "cuda:1"]
    assert tl.column("bytes").tolist() == [100, 7, 9, 100]
    assert [tl.devices[d] for d in tl.column("device")] == ["cuda:0", "cuda:1", "cuda:1", "cuda:0"]
    assert tl.baseline_bytes == 0 and tl.end_bytes == 16
    assert tl.meta["reserved_bytes"] == {"cuda:1": 1024}


def py_frame(i):
    return {"filename": f"/src/model/layer{i}.py", "line": 10 + i, "name": f"fn{i}"}


def cpp_frame(i):
    return {"filename": "c10/cuda/CUDACachingAllocator.cpp", "line": i, "name": f"c10::cuda::malloc{i}"}


def test_frames_become_the_innermost_python_frames_outermost_first():
    python = [py_frame(i) for i in range(12)]  # innermost first, as torch writes them
    trace = [
        entry("alloc", BASE, 8, 1, frames=python),
        entry("alloc", BASE + 512, 8, 2, frames=[cpp_frame(0), cpp_frame(1), *python]),  # stacks="all"
        entry("alloc", BASE + 1024, 8, 3, frames=[]),
        entry("alloc", BASE + 1536, 8, 4),  # context=None: no frames key at all
    ]
    tl = read_snapshot({"segments": [], "device_traces": [trace]})
    expected = "\n".join(f"/src/model/layer{i}.py:{10 + i} fn{i}" for i in reversed(range(STACK_FRAMES)))
    frame = tl.column("frame").tolist()
    assert tl.frames[frame[0]] == expected
    assert tl.frames[frame[1]] == expected
    assert frame[2:] == [-1, -1]


def test_stacks_of_shared_frame_dicts_are_told_apart_like_a_per_entry_decode():
    # torch's symbolizer shares frame dicts between stacks but gives each entry its own list: the hashed path
    rng = random.Random(0)
    pool = [py_frame(i) for i in range(40)]
    stacks = [[rng.choice(pool) for _ in range(rng.randint(0, 14))] for _ in range(60)]
    stacks += [list(reversed(stacks[1])), stacks[2][:3], stacks[2][:3] + [pool[0]]]  # order and depth matter
    trace, chosen = [], []
    for i in range(3000):
        s = rng.choice(stacks)
        chosen.append(s)
        trace.append(entry("alloc", BASE + 512 * i, 8, i, frames=list(s)))
    tl = read_snapshot({"segments": [], "device_traces": [trace]})

    def text(s):
        return "\n".join(f"{f['filename']}:{f['line']} {f['name']}" for f in reversed(s[:STACK_FRAMES])) or None

    got = [tl.frames[f] if f >= 0 else None for f in tl.column("frame").tolist()]
    assert got == [text(s) for s in chosen]


def test_profiler_categories_are_understood_and_a_free_takes_its_allocs():
    trace = [
        entry("alloc", BASE, 64, 1, category="activation"),
        entry("alloc", BASE + 512, 32, 2, category="autograd_detail"),
        entry("free_requested", BASE, 64, 3),
        entry("free_completed", BASE, 64, 3),
    ]
    seg = segment(0, BASE, [(512, 0, "inactive"), (512, 32, "active_allocated")])
    tl = read_snapshot({"segments": [seg], "device_traces": [trace]})
    assert [CATEGORIES[c] for c in tl.column("category")] == ["activation", "temporary", "activation"]
    assert tl.peak_by_category()["activation"] == 64


def test_categories_that_memkit_does_not_know_or_that_are_damaged_read_as_the_default():
    trace = [
        entry("alloc", BASE, 64, 1, category="activation"),
        entry("alloc", BASE + 512, 32, 2),  # no category beside ones that have one
        entry("alloc", BASE + 1024, 16, 3, category="weights"),  # not one of memkit's
        entry("alloc", BASE + 1536, 8, 4, category=["activation"]),  # damaged
        entry("alloc", BASE + 2048, 4, 5, category=3),
    ]
    tl = read_snapshot({"segments": [], "device_traces": [trace]}, default_category="parameter")
    assert [CATEGORIES[c] for c in tl.column("category")] == ["activation"] + ["parameter"] * 4
    assert tl.meta["free_action"] == {"cuda:0": "free_completed"}  # no free at all: torch's default


def test_a_bare_list_of_segments_is_the_state_without_a_trace():
    tl = read_snapshot(hand_snapshot()["segments"])
    assert len(tl) == 0
    assert tl.baseline_bytes == tl.end_bytes == tl.peak_bytes == 6500


def test_an_inconsistent_snapshot_reports_the_bytes_it_cannot_explain():
    data = hand_snapshot()
    data["device_traces"][0].insert(1, entry("alloc", BASE + 0x3000, 64, 95))  # B's address, allocated twice
    tl = read_snapshot(data)
    assert tl.meta["unaccounted_bytes"] == {"cuda:0": -64}


def test_a_block_the_trace_freed_last_but_the_segments_hold_is_the_baseline():
    # allocations made while the history was paused are missing from the trace: X was allocated again unseen
    X = BASE + 0x1000
    trace = [entry("alloc", X, 100, 10), entry("free_completed", X, 100, 20)]
    tl = read_snapshot({"segments": [segment(0, X, [(512, 100, "active_allocated")])], "device_traces": [trace]})
    assert tl.baseline_bytes == 100 and tl.live_bytes.tolist() == [200, 100]
    assert tl.end_bytes == 100 and "unaccounted_bytes" not in tl.meta


def test_a_time_before_the_entry_above_it_is_taken_as_that_entrys():
    stamps = [100, 90, 95, 200]  # 90 and 95: clock jitter between threads
    trace = [entry("alloc", BASE + 512 * i, 8, t) for i, t in enumerate(stamps)]
    tl = read_snapshot({"segments": [], "device_traces": [trace]})
    taken = [max(stamps[: i + 1]) for i in range(len(stamps))]
    assert tl.time.tolist() == [(t - taken[0]) / 1e6 for t in taken]
    assert tl.meta["time_unit"] == "s"


def test_devices_at_the_same_microsecond_keep_each_traces_order():
    # each block allocated and freed within one microsecond, on both devices: only a stable merge keeps every
    # free after its alloc (numpy's default sort reorders ties in arrays this long)
    n = 40
    traces = [
        [entry(action, BASE + 512 * i, 8 + d, 100 + i) for i in range(n) for action in ("alloc", "free_completed")]
        for d in range(2)
    ]
    tl = read_snapshot({"segments": [], "device_traces": traces})
    device, storage = tl.column("device"), tl.column("storage")
    for d, trace in enumerate(traces):
        assert storage[device == d].tolist() == [e["addr"] for e in trace]
    assert tl.baseline_bytes == tl.end_bytes == 0
    assert tl.peak_bytes == 8 + 1  # at each microsecond device 0's pair, then device 1's: one block at a time


def oom(size, device_free, time_us=None):
    e = {"action": "oom", "size": size, "device_free": device_free, "stream": 0, "frames": []}
    return e if time_us is None else {**e, "time_us": time_us}


def test_out_of_memory_errors_are_listed_with_their_device_bytes_and_time():
    d0 = [entry("alloc", BASE, 100, 1_000), oom(4096, 512, 3_000), entry("free_completed", BASE, 100, 4_000)]
    d1 = [
        entry("alloc", BASE, 7, 2_000),
        oom(True, float("nan")),  # numbers that are not byte counts, and no time: None
        oom(2048.0, float("inf"), 5_000),
        entry("snapshot", 0, 0, 6_000),
    ]
    tl = read_snapshot({"segments": [], "device_traces": [d0, d1]})
    zero = 1_000  # the first event's time_us
    assert tl.meta["out_of_memory"] == [
        {"device": "cuda:0", "requested_bytes": 4096, "device_free_bytes": 512, "time": (3_000 - zero) / 1e6},
        {"device": "cuda:1", "requested_bytes": None, "device_free_bytes": None, "time": None},
        {"device": "cuda:1", "requested_bytes": 2048, "device_free_bytes": None, "time": (5_000 - zero) / 1e6},
    ]
    assert len(tl) == 3  # an oom is no event
    assert tl.meta["trace_entries"] == {"cuda:0": len(d0), "cuda:1": len(d1)}
    assert tl.meta["source"] == "snapshot" and tl.meta["time_unit"] == "s"


def test_a_memkit_snapshot_of_event_indices_reads_back_in_events(tmp_path):
    rows = [(0.0, ALLOC, 64, 0, 0, 0, -1, -1, 1), (1.0, FREE, 64, 0, 0, 0, -1, -1, 1)]
    cols = {name: [r[i] for r in rows] for i, (name, _) in enumerate(COLUMNS)}
    for unit in ("event", "s"):
        tl = Timeline(cols, devices=["cuda:0"], meta={"time_unit": unit})
        assert read_snapshot(write_snapshot(tl, tmp_path / f"{unit}.pickle")).meta["time_unit"] == unit


def marker(category, phase):
    return {"filename": "memkit", "line": 0, "name": f"category={category} phase={phase}"}


def test_a_free_keeps_the_phase_its_marker_names_and_else_takes_its_allocs():
    forward = {"filename": "/src/model/block.py", "line": 3, "name": "forward"}
    trace = [
        entry("alloc", BASE, 64, 1, frames=[forward]),  # the device's first entry
        entry("free_completed", BASE, 64, 2),  # torch's: no phase of its own
        entry("alloc", BASE + 512, 32, 3, frames=[marker("activation", "backward")]),
        entry("free_completed", BASE + 512, 32, 4, frames=[marker("activation", PHASES[0])]),
    ]
    tl = read_snapshot({"segments": [], "device_traces": [trace]})
    assert [PHASES[p] for p in tl.column("phase")] == ["forward", "forward", "backward", PHASES[0]]


def test_granularity_one_rounds_nothing():
    as_traced = read_snapshot(hand_snapshot()).column("bytes").tolist()
    assert read_snapshot(hand_snapshot(), alloc_granularity=1).column("bytes").tolist() == as_traced


def test_segments_are_summed_per_device_and_unknown_block_states_are_kept():
    expandable = {
        **segment(0, BASE, [(0x1000, 4000, "active_allocated"), (0x2000, 0, "inactive")]),
        "is_expandable": True,
    }
    second = segment(0, BASE + 0x10000, [(0x800, 100, "active_pending_free"), (0x400, 0, "future_state")])
    full = segment(1, BASE, [(0x1000, 0x1000, "active_allocated")])  # no inactive block
    tl = read_snapshot({"segments": [expandable, second, full], "device_traces": []})
    assert len(tl) == 0 and tl.meta["time_unit"] == "s"  # no trace: no event, and the axis is still in seconds
    s0, s1 = tl.meta["segments"]["cuda:0"], tl.meta["segments"]["cuda:1"]
    assert (s0["segments"], s0["expandable_segments"]) == (2, 1)
    reserved = expandable["total_size"] + second["total_size"]
    assert s0["reserved_bytes"] == reserved
    assert s0["blocks"]["future_state"] == {"count": 1, "bytes": 0x400}  # a state this reader does not know
    assert s0["blocks"]["active_pending_free"] == {"count": 1, "bytes": 0x800}
    assert s0["largest_inactive_block"] == 0x2000
    assert s1["largest_inactive_block"] == 0 and s1["blocks"]["inactive"] == {"count": 0, "bytes": 0}
    assert tl.meta["reserved_bytes"] == {"cuda:0": reserved, "cuda:1": full["total_size"]}
    assert tl.baseline_bytes == 4000 + 100 + 0x1000


def test_what_older_snapshots_omit_from_a_segment_reads_as_none_or_tiled():
    # no device, total_size, address or blocks; blocks without an address or requested_size
    bare = {"segment_type": "small"}
    tiled = {
        "total_size": 1024,
        "blocks": [{"size": 512, "state": "active_allocated"}, {"size": 512, "state": "inactive"}],
    }
    tl = read_snapshot({"segments": [bare, tiled], "device_traces": [[entry("alloc", 0, 300, 1)]]})
    assert tl.devices == ["cuda:0"]
    assert tl.meta["reserved_bytes"] == {"cuda:0": 1024} and tl.meta["segments"]["cuda:0"]["segments"] == 2
    # the block at offset 0 is the trace's alloc: not baseline; it holds its whole size (no requested_size)
    assert tl.baseline_bytes == 0 and tl.meta["unaccounted_bytes"] == {"cuda:0": 512 - 300}


def test_blocks_are_matched_to_the_trace_by_their_own_address():
    seg = {
        "device": 1,
        "total_size": 1024,
        "blocks": [{"address": BASE, "size": 1024, "requested_size": 300, "state": "active_allocated"}],
    }
    tl = read_snapshot({"segments": [seg], "device_traces": [[], [entry("alloc", BASE, 300, 1)]]})
    assert tl.devices == ["cuda:1"] and tl.baseline_bytes == 0 and tl.end_bytes == 300
    assert "unaccounted_bytes" not in tl.meta


def test_a_pre_trace_block_takes_its_category_key_and_adds_no_frame_text():
    seg = segment(0, BASE, [(512, 64, "active_allocated"), (512, 32, "active_allocated")])
    seg["blocks"][0].update(category="parameter", frames=[py_frame(1)])
    trace = [entry("alloc", BASE + 512, 32, 1)]
    tl = read_snapshot({"segments": [seg], "device_traces": [trace]}, default_category="temporary")
    assert tl.baseline_by_category == {**dict.fromkeys(CATEGORIES, 0), "parameter": 64}
    assert tl.frames == []  # a block's stack is no event's frame


@pytest.mark.parametrize("device", [-1, _MAX_DEVICES])
def test_a_segment_on_no_device_index_is_refused_by_name(device):
    with pytest.raises(SnapshotError, match=rf"segments\[0\] is malformed.*device {device} is not a device index"):
        read_snapshot({"segments": [segment(device, BASE, [(512, 8, "active_allocated")])], "device_traces": []})


# ---- a real CPU profile, through torch's own conversion -------------------------------------------------------


def test_a_real_cpu_profile_converted_by_torch_keeps_the_profiles_peak():
    from torch.profiler._memory_profiler import Action, TensorKey

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 32))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(16, 32)
    activities = [torch.profiler.ProfilerActivity.CPU]
    with torch.profiler.profile(activities=activities, profile_memory=True, record_shapes=True, with_stack=True) as p:
        model(x).square().mean().backward()
        opt.step()
    data = _memory_viz._profile_to_snapshot(p)  # CPU events land on device index cuda.device_count() == 0

    # the profile's own numbers, over the tensors that the conversion keeps
    sign = {Action.PREEXISTING: 1, Action.CREATE: 1, Action.DESTROY: -1, Action.INCREMENT_VERSION: 0}
    live = peak = before = 0
    for _, action, (key, _version), nbytes in p._memory_profile().timeline:
        if isinstance(key, TensorKey):
            before += nbytes if action == Action.PREEXISTING else 0
            live += sign[action] * nbytes
            peak = max(peak, live)

    tl = read_snapshot(data, device_names=["cpu"])
    assert (tl.baseline_bytes, tl.peak_bytes, tl.end_bytes) == (before, peak, live)
    assert tl.devices == ["cpu"] and tl.meta["time_unit"] == "event"  # the conversion writes no times
    assert tl.peak_by_category()["activation"] > 0 and tl.peak_by_category()["gradient"] > 0
    assert any("forward" in text for text in tl.frames)
    # phases come from the Python frames the profiler names ("torch/optim/sgd.py(...): step", "...: backward")
    allocs = tl.column("action") == ALLOC
    pairs = zip(tl.column("phase")[allocs], tl.column("category")[allocs], strict=True)
    seen = {(PHASES[p], CATEGORIES[c]) for p, c in pairs}
    assert {("backward", "gradient"), ("forward", "activation")} <= seen


# ---- writing ----------------------------------------------------------------------------------------------------

VIZ_OPCODES = {  # the opcodes MemoryViz.js's own unpickle() implements
    "PROTO", "APPEND", "APPENDS", "LIST", "TUPLE", "NEWFALSE", "NEWTRUE", "NONE", "BINGET", "BININT", "BININT1",
    "BININT2", "EMPTY_DICT", "EMPTY_LIST", "FRAME", "LONG1", "LONG_BINGET", "MARK", "MEMOIZE", "BINPUT",
    "LONG_BINPUT", "SETITEMS", "SETITEM", "DICT", "SHORT_BINUNICODE", "BINUNICODE", "STOP", "EMPTY_TUPLE",
    "TUPLE1", "TUPLE2", "TUPLE3", "BINFLOAT",
}  # fmt: skip


def check_viz_contract(data):
    """What torch's viewers assume of a snapshot, restated from MemoryViz.js and _memory_viz.py."""
    assert {op.name for op, _, _ in pickletools.genops(pickle.dumps(data, protocol=4))} <= VIZ_OPCODES
    for device, trace in enumerate(data["device_traces"]):
        categories = {e["category"] for e in trace if "category" in e}
        assert not categories or "unknown" in categories  # else annotate_snapshot hits its `categores` typo
        segs = [s for s in data["segments"] if s["device"] == device]
        live = {}
        for s in segs:  # blocks tile their segment from its address (annotate_snapshot recomputes b.addr so)
            addr = s["address"]
            for b in s["blocks"]:
                assert b["address"] == addr
                if b["state"] == "active_allocated":
                    live[addr] = b["requested_size"]
                addr += b["size"]
            assert addr == s["address"] + s["total_size"]

        def inside(a, segs=segs):
            return any(s["address"] <= a < s["address"] + s["total_size"] for s in segs)

        for i, e in enumerate(trace):
            assert e["stream"] == 0 and isinstance(e["time_us"], int) and isinstance(e["frames"], list)
            if e["action"] == "free_requested":  # elided into one "free" by the viz
                assert trace[i + 1]["action"] == "free_completed" and trace[i + 1]["addr"] == e["addr"]
        for e in reversed(trace):  # MemoryView.simulate_memory: from the final state back to the start
            if e["action"] == "free_completed":
                assert e["addr"] not in live and inside(e["addr"])
                live[e["addr"]] = e["size"]
            elif e["action"] == "alloc":
                assert live.pop(e["addr"]) == e["size"]


def tiny_step_timeline(**track_kwargs):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 16))
    opt = torch.optim.AdamW(model.parameters())
    x = torch.randn(8, 16)

    def step():
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()

    step()  # the optimizer state exists before the window
    with memkit.track(model, optimizer=opt, inputs=x, **track_kwargs) as tl:
        step()
        del opt.state[next(iter(opt.state))]["exp_avg"]  # a pre-window storage freed inside the window
    return tl


def names(tl, column, table):
    return [table[c] if c >= 0 else None for c in tl.column(column).tolist()]


def assert_same_timeline(a, b):
    for column in ("action", "bytes", "category", "phase"):
        np.testing.assert_array_equal(a.column(column), b.column(column), err_msg=column)
    assert names(a, "device", a.devices) == names(b, "device", b.devices)
    assert names(a, "op", a.ops) == names(b, "op", b.ops)
    assert names(a, "frame", a.frames) == names(b, "frame", b.frames)
    assert a.baseline_by_category == b.baseline_by_category
    assert (a.peak_bytes, a.end_bytes) == (b.peak_bytes, b.end_bytes)
    np.testing.assert_allclose(a.time, b.time, atol=1e-6)


def test_a_tracked_step_round_trips_through_a_snapshot_file(tmp_path):
    tl = tiny_step_timeline(record_stacks=True, label="tiny")
    assert tl.baseline_by_category["optimizer_state"] > 0 and any(np.asarray(tl.column("frame")) >= 0)
    path = tmp_path / "step.pickle"
    data = write_snapshot(tl, path)
    check_viz_contract(data)
    for source in (path, str(path), path.read_bytes(), io.BytesIO(path.read_bytes()), data):
        back = read_snapshot(source)
        assert_same_timeline(tl, back)
        assert back.meta["label"] == "tiny" and "unaccounted_bytes" not in back.meta
    assert pickle.loads(path.read_bytes()) == data


def test_torch_own_viz_functions_accept_what_we_write():
    data = write_snapshot(tiny_step_timeline())
    assert "total_reserved" in _memory_viz.segsum(data)
    assert "TOTAL MEM" in _memory_viz.trace(data)
    for html in (
        _memory_viz.trace_plot(data),
        _memory_viz.trace_plot(data, plot_segments=True),
        _memory_viz.segment_plot(data),
        _memory_viz.trace_plot(pickle.loads(pickle.dumps(data)), filter_freed=True),
    ):
        assert "add_local_files" in html
    # the category the viz colours by, and memkit's marker on top of each stack
    alloc = next(e for e in data["device_traces"][0] if e["action"] == "alloc")
    assert alloc["category"] in CATEGORIES
    assert alloc["frames"][0]["filename"] == "memkit" and alloc["frames"][0]["name"].startswith("category=")


def test_written_device_names_and_indices():
    cols = {"time": [0.0, 1.0], "action": [ALLOC, ALLOC], "bytes": [10, 20], "category": [6, 6], "phase": [4, 4]}
    cols |= {"device": [0, 1], "storage": [1, 2]}
    data = write_snapshot(Timeline(cols, devices=["cuda:2", "cuda:0"]))
    assert [len(t) for t in data["device_traces"]] == [2, 0, 2]  # an alloc and the closing "snapshot" entry
    assert read_snapshot(data).devices == ["cuda:0", "cuda:2"]
    data = write_snapshot(Timeline(cols, devices=["cpu", "meta"]))
    assert read_snapshot(data).devices == ["cpu", "meta"]
    check_viz_contract(data)


def test_write_refuses_a_timeline_that_frees_more_than_its_baseline():
    cols = {"time": [0.0], "action": [FREE], "bytes": [10], "category": [0], "phase": [4], "device": [0]}
    cols["storage"] = [5]
    with pytest.raises(ValueError, match="baseline"):
        write_snapshot(Timeline(cols, devices=["cpu"], baseline_by_category={"parameter": 4}))
    with pytest.raises(TypeError, match="Timeline"):
        write_snapshot({"segments": []})


def test_timeline_methods_round_trip_a_tracked_step_through_a_file(tmp_path):
    tl = tiny_step_timeline(record_stacks=True)
    path = tmp_path / "step.pickle"
    data = tl.to_snapshot(path)
    assert pickle.loads(path.read_bytes()) == data
    back = Timeline.from_snapshot(path)
    assert back.peak_bytes == tl.peak_bytes and back.peak_index == tl.peak_index
    assert back.peak_by_category() == tl.peak_by_category()
    np.testing.assert_array_equal(back.column("bytes"), tl.column("bytes"))
    np.testing.assert_array_equal(back.signed_bytes, tl.signed_bytes)
    assert_same_timeline(tl, back)
    # keyword arguments reach read_snapshot
    rounded = Timeline.from_snapshot(path, alloc_granularity=CUDA_BLOCK, device_names=["gpu"])
    assert rounded.devices == ["gpu"]
    assert rounded.column("bytes").tolist() == [round_alloc(n, CUDA_BLOCK) for n in tl.column("bytes").tolist()]
    # without a path nothing is written
    assert_same_timeline(tl, Timeline.from_snapshot(tl.to_snapshot()))
    assert [p.name for p in tmp_path.iterdir()] == ["step.pickle"]


@given(st.integers(0, 1 << 40), st.integers(1, 4096))
def test_round_alloc_is_the_smallest_multiple_of_at_least_one_block(nbytes, granularity):
    r = round_alloc(nbytes, granularity)
    assert r % granularity == 0 and r >= max(nbytes, granularity) and r - granularity < max(nbytes, 1)
    assert round_alloc(np.array([nbytes]), granularity).tolist() == [r]
    assert round_alloc(nbytes, None) == round_alloc(nbytes, 0) == nbytes


def test_written_blocks_are_rounded_like_the_reader_and_tracker_round():
    tl = tiny_step_timeline()
    data = write_snapshot(tl)
    for seg in data["segments"]:
        for b in seg["blocks"]:
            if b["state"] == "active_allocated":
                assert b["size"] == round_alloc(b["requested_size"], CUDA_BLOCK)
    rounded = tiny_step_timeline(alloc_granularity=CUDA_BLOCK)
    assert rounded.column("bytes").tolist() == [round_alloc(n, CUDA_BLOCK) for n in tl.column("bytes").tolist()]
    back = read_snapshot(data, alloc_granularity=CUDA_BLOCK)
    np.testing.assert_array_equal(back.column("bytes"), rounded.column("bytes"))


@st.composite
def timelines(draw):
    """Random windows: allocations, frees in any order (keys reused after a free), pre-window storages freed."""
    before = draw(st.lists(st.tuples(st.integers(1, 5000), st.integers(0, len(CATEGORIES) - 1)), max_size=4))
    baseline = dict.fromkeys(CATEGORIES, 0)
    for nbytes, cat in before:
        baseline[CATEGORIES[cat]] += nbytes
    baseline["parameter"] += draw(st.integers(0, 10_000))
    live, rows, t = {}, [], 0.0
    waiting = [(1000 + i, n, c) for i, (n, c) in enumerate(before)]
    for step in draw(st.lists(st.tuples(st.integers(0, 2), st.integers(1, 10_000)), max_size=40)):
        kind, value = step
        t += value / 1e4
        if kind == 0 or not (live or waiting):
            key = draw(st.sampled_from(sorted(set(range(6)) - set(live)) or [99]))
            if key in live:
                continue
            cat, phase = value % len(CATEGORIES), value % 5
            device = draw(st.integers(0, 1))
            live[key] = (value, cat, device)
            rows.append((t, ALLOC, value, cat, phase, device, value % 3 - 1, value % 4 - 1, key))
        elif kind == 1 and waiting:
            key, nbytes, cat = waiting.pop()
            rows.append((t, FREE, nbytes, cat, value % 5, 0, -1, -1, key))
        elif live:
            key = sorted(live)[value % len(live)]
            nbytes, cat, device = live.pop(key)  # a storage lives on one device
            rows.append((t, FREE, nbytes, cat, value % 5, device, -1, -1, key))
    cols = {name: [r[i] for r in rows] for i, (name, _) in enumerate(COLUMNS)}
    devices = draw(st.sampled_from([["cuda:0", "cuda:1"], ["cpu", "cuda:0"]]))
    return Timeline(cols, baseline_by_category=baseline, devices=devices, ops=["aten.mm", "aten.add"],
                    frames=["a.py:1 f", "a.py:1 f\nb.py:2 g", "<stdin>:3 <module>"])  # fmt: skip


@settings(max_examples=60, deadline=None)
@given(timelines())
def test_any_timeline_round_trips(tl):
    data = write_snapshot(tl)
    check_viz_contract(data)
    back = read_snapshot(data)
    assert "unaccounted_bytes" not in back.meta
    assert_same_timeline(tl, back)


# ---- safety -----------------------------------------------------------------------------------------------------


class RunsCommand:
    def __init__(self, call, arg):
        self.call, self.arg = call, arg

    def __reduce__(self):
        return self.call, (self.arg,)


@pytest.mark.parametrize("how", ["os.system", "builtins.eval"])
def test_a_crafted_pickle_is_refused_and_runs_nothing(tmp_path, how):
    marker = tmp_path / "pwned"
    payload = (os.system, f"touch {marker}") if how == "os.system" else (builtins.eval, f"open({str(marker)!r}, 'w')")
    evil = {"segments": [], "device_traces": [[RunsCommand(*payload)]]}
    path = tmp_path / "evil.pickle"
    path.write_bytes(pickle.dumps(evil, protocol=4))
    for source in (path, path.read_bytes()):
        with pytest.raises(SnapshotError, match=r"refused to load the global .*(system|eval)"):
            read_snapshot(source)
    assert not marker.exists()


def test_a_valid_snapshot_dict_holding_a_global_is_refused():
    # everything else about it is a snapshot, so only the refusal of the global can reject it
    evil = pickle.dumps({"segments": [], "device_traces": [], "allocator_settings": {"hook": os.system}})
    refused = rf"refused to load the global {os.system.__module__}\.system"
    with pytest.raises(SnapshotError, match=refused):
        read_snapshot(evil)
    with pytest.raises(SnapshotError, match=refused):
        load_snapshot(io.BytesIO(evil))


# Globals that look harmless: standard-library containers and constructors, copyreg's helpers, numpy's and
# torch's rebuilders. A snapshot needs none of them, so the reader's allow-list is empty: every one is refused.
HARMLESS_LOOKING_GLOBALS = [
    ("collections", "OrderedDict"),
    ("collections", "defaultdict"),
    ("collections", "deque"),
    ("collections", "Counter"),
    ("collections", "namedtuple"),
    ("builtins", "set"),
    ("builtins", "frozenset"),
    ("builtins", "dict"),
    ("builtins", "list"),
    ("builtins", "tuple"),
    ("builtins", "bytearray"),
    ("builtins", "bytes"),
    ("builtins", "complex"),
    ("builtins", "slice"),
    ("builtins", "range"),
    ("builtins", "int"),
    ("builtins", "float"),
    ("builtins", "str"),
    ("builtins", "bool"),
    ("builtins", "object"),
    ("builtins", "getattr"),
    ("__builtin__", "set"),  # Python 2's name, which pickle's fix_imports maps to builtins
    ("copyreg", "_reconstructor"),
    ("copyreg", "__newobj__"),
    ("copy_reg", "_reconstructor"),
    ("datetime", "datetime"),
    ("decimal", "Decimal"),
    ("fractions", "Fraction"),
    ("functools", "partial"),
    ("operator", "itemgetter"),
    ("types", "SimpleNamespace"),
    ("_codecs", "encode"),
    ("numpy", "dtype"),
    ("numpy.core.multiarray", "_reconstruct"),
    ("torch", "Size"),
    ("torch._utils", "_rebuild_tensor_v2"),
]


def _text(s: str) -> bytes:
    data = s.encode()
    return b"X" + len(data).to_bytes(4, "little") + data  # BINUNICODE


def _crafted_snapshot(value: bytes, protocol: int) -> bytes:
    """``{"segments": [], "device_traces": [], "allocator_settings": {"hook": <value>}}`` written opcode by
    opcode (nothing is pickled, so nothing runs to build it): a valid snapshot but for ``value``."""
    return (
        b"\x80" + bytes([protocol])
        + b"}(" + _text("segments") + b"]" + _text("device_traces") + b"]"
        + _text("allocator_settings") + b"}" + _text("hook") + value + b"s"
        + b"u."
    )  # fmt: skip


def _global(module: str, name: str, opcode: str) -> bytes:
    if opcode == "GLOBAL":
        return b"c" + module.encode() + b"\n" + name.encode() + b"\n"
    return _text(module) + _text(name) + b"\x93"  # STACK_GLOBAL (protocol 4)


def test_the_crafted_snapshot_without_a_global_is_read():
    # the control for the test below: the same bytes with a string in the global's place are a snapshot
    for protocol in (2, 4):
        tl = read_snapshot(_crafted_snapshot(_text("os.system"), protocol))
        assert len(tl) == 0


@pytest.mark.parametrize("opcode", ["GLOBAL", "STACK_GLOBAL"])
@pytest.mark.parametrize(
    ("module", "name"), HARMLESS_LOOKING_GLOBALS, ids=[f"{m}.{n}" for m, n in HARMLESS_LOOKING_GLOBALS]
)
def test_every_global_is_refused_even_a_harmless_looking_one(module, name, opcode):
    raw = _crafted_snapshot(_global(module, name, opcode), 2 if opcode == "GLOBAL" else 4)
    ops = [op.name for op, _, _ in pickletools.genops(raw)]  # parsed, not run
    assert ops.count(opcode) == 1 and not {"GLOBAL", "STACK_GLOBAL", "REDUCE", "INST", "OBJ"} & set(ops) - {opcode}
    refused = rf"^refused to load the global {re.escape(module)}\.{re.escape(name)}: "
    with pytest.raises(SnapshotError, match=refused):
        read_snapshot(raw)
    with pytest.raises(SnapshotError, match=refused):
        load_snapshot(io.BytesIO(raw))


def test_refusals_say_that_nothing_was_run_and_what_a_snapshot_holds():
    evil = pickle.dumps({"segments": [], "device_traces": [[RunsCommand(print, "hi")]]})
    with pytest.raises(SnapshotError) as info:
        read_snapshot(evil)
    assert str(info.value).endswith(
        "a memory snapshot holds only dicts, lists, strings and numbers, so this pickle is not one (it may have "
        "been crafted to run code; nothing was run)"
    )


def test_a_persistent_id_is_refused():
    class P(pickle.Pickler):
        def persistent_id(self, obj):
            return "x" if obj == "secret" else None

    buf = io.BytesIO()
    P(buf, protocol=4).dump({"segments": [], "device_traces": [["secret"]]})
    with pytest.raises(
        SnapshotError, match=r"^refused a persistent id: a memory snapshot has none, so this pickle is not one$"
    ):
        read_snapshot(buf.getvalue())


def test_truncated_random_and_empty_bytes_raise_snapshot_errors(tmp_path):
    good = pickle.dumps(hand_snapshot(), protocol=4)
    for cut in (len(good) // 2, len(good) - 1, 1):
        with pytest.raises(SnapshotError, match="truncated"):
            read_snapshot(good[:cut])
    with pytest.raises(SnapshotError, match="truncated"):
        read_snapshot(b"")
    rng = np.random.default_rng(0)
    for _ in range(20):
        with pytest.raises(SnapshotError):
            read_snapshot(rng.bytes(200))
    path = tmp_path / "cut.pickle"
    path.write_bytes(good[:100])
    with pytest.raises(SnapshotError, match=r"cut\.pickle.* truncated"):
        read_snapshot(path)


def test_a_file_that_is_no_pickle_and_one_cut_short_say_which_and_why(tmp_path):
    path = tmp_path / "snapshot.json"  # the wrong file
    path.write_text('{"segments": [], "device_traces": []}')
    with pytest.raises(SnapshotError, match=r"snapshot\.json' is corrupted or not a pickle: UnpicklingError: invalid"):
        read_snapshot(path)
    cut = pickle.dumps(hand_snapshot(), protocol=4)[:-40]  # inside the pickle's frame: no EOFError here
    with pytest.raises(SnapshotError, match=r"^the snapshot bytes is truncated: UnpicklingError: pickle data was"):
        read_snapshot(cut)


def test_a_bad_file_object_is_named_in_the_error_or_said_to_have_no_name(tmp_path):
    path = tmp_path / "snapshot.json"
    path.write_text("not a pickle")
    with open(path, "rb") as f, pytest.raises(SnapshotError) as info:
        read_snapshot(f)
    assert str(info.value).startswith(f"snapshot file {str(path)!r} is corrupted")
    with pytest.raises(SnapshotError, match=r"^snapshot file '<file object>' is corrupted"):
        read_snapshot(io.BytesIO(b"not a pickle"))


def test_a_malformed_entry_is_quoted_in_the_error_cut_at_120_characters():
    long = {"action": "alloc", "size": 8, "note": "x" * 300}  # lacks addr
    for bad, what in (
        (long, "(alloc) lacks 'addr' or 'size'"),
        ({"size": 8, "note": "y" * 300}, "is not a trace entry"),
    ):
        with pytest.raises(SnapshotError) as info:
            read_snapshot({"segments": [], "device_traces": [[entry("alloc", BASE, 8, 1), bad]]})
        message = str(info.value)
        assert f"device_traces[0][1] {what}" in message and message.endswith(": " + str(bad)[:120])


def test_other_pickles_and_malformed_snapshots_name_what_is_wrong():
    with pytest.raises(SnapshotError, match=r"missing \['segments', 'device_traces'\]"):
        read_snapshot(pickle.dumps({"weights": [1, 2]}))
    with pytest.raises(SnapshotError, match=r"missing \['device_traces'\]"):
        read_snapshot({"segments": []})
    with pytest.raises(SnapshotError, match="got a int"):
        read_snapshot(pickle.dumps(3))
    with pytest.raises(SnapshotError, match=r"^not a CUDA memory snapshot: 'segments' must be a list of dicts$"):
        read_snapshot(pickle.dumps([1, 2, 3]))
    many = {f"key{i}": i for i in range(12)}
    with pytest.raises(SnapshotError) as info:
        read_snapshot(many)
    assert str(info.value).endswith(f"(keys found: {sorted(many)[:8]})")  # a few of them, not all
    with pytest.raises(SnapshotError, match=r"^not a CUDA memory snapshot: 'device_traces' must be a list \(one per"):
        read_snapshot({"segments": [], "device_traces": [{"action": "alloc"}]})
    bad = hand_snapshot()
    del bad["device_traces"][0][4]["addr"]
    with pytest.raises(SnapshotError, match=r"device_traces\[0\]\[4\] \(alloc\) lacks 'addr'"):
        read_snapshot(bad)
    bad = hand_snapshot()
    bad["segments"][0]["blocks"][0] = "block"
    with pytest.raises(SnapshotError, match=r"segments\[0\] is malformed"):
        read_snapshot(bad)
    with pytest.raises(TypeError, match="^source must be .*, got int$"):
        read_snapshot(42)
    with pytest.raises(FileNotFoundError):
        read_snapshot("/nonexistent/snapshot.pickle")


def test_load_snapshot_gives_torchs_dict_for_torchs_tools(tmp_path):
    path = tmp_path / "s.pickle"
    path.write_bytes(pickle.dumps(hand_snapshot(), protocol=4))
    data = load_snapshot(path)
    assert data == hand_snapshot()
    read_only = load_snapshot(types.MappingProxyType(hand_snapshot()))  # any Mapping: given back as a plain dict
    assert type(read_only) is dict and read_only == hand_snapshot()
    assert "total_reserved" in _memory_viz.segsum(data)


# ---- CUDA recording -----------------------------------------------------------------------------------------------


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message where CUDA is missing")
def test_cuda_history_says_clearly_why_it_cannot_run_here():
    assert cuda_history_available() is False
    for call in (record_cuda_history, cuda_snapshot):
        with pytest.raises(CudaHistoryError, match="CUDA.*memkit.track") as info:
            call()
        assert not isinstance(info.value, AttributeError)
    with pytest.raises(ValueError, match="max_entries"):
        record_cuda_history(max_entries=0)
    with pytest.raises(ValueError, match="stacks"):
        record_cuda_history(stacks="cpp")


def test_cuda_history_without_the_private_api_names_what_is_missing(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.delattr(torch.cuda.memory, "_snapshot")
    with pytest.raises(CudaHistoryError, match=r"no torch\.cuda\.memory\._snapshot"):
        record_cuda_history()


def test_cuda_history_calls_torch_as_documented(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch._C, "_cuda_record_memory_history", lambda *a: None, raising=False)
    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history", lambda **kw: calls.append(kw))
    monkeypatch.setattr(torch.cuda.memory, "_snapshot", hand_snapshot)
    assert cuda_history_available()
    with record_cuda_history(max_entries=1234) as handle:
        tl = cuda_snapshot(default_category="parameter")
    assert not handle.active
    handle.remove()  # a second remove does not stop a recording someone else started
    assert calls == [
        {"enabled": "all", "context": "all", "stacks": "python", "max_entries": 1234},
        {"enabled": None},
    ]
    assert tl.peak_bytes == 7500 and tl.baseline_by_category["parameter"] == 4300
