"""Snapshots per device, with honest axes (issue 12): each device keeps its trace's order when its clock jitters,
a peak that no event reached is called the baseline (no time, no event index), a trace of markers alone is not
called "segments only", a device without events holds its baseline across the plot, and a snapshot's baseline
is drawn and named as what it is. Fixtures are plain data in torch's schema, pickled without a single global;
expected values come from the walk below, written without the reader.
"""

import json
import pickle
import pickletools

import numpy as np
import pytest

from memkit import plots
from memkit.cli import main
from memkit.memory import PHASES
from memkit.memory.snapshot import read_snapshot

MiB = 1 << 20


def entry(action, addr, size, t=None, frames=()):
    e = {"action": action, "addr": addr, "size": size, "stream": 0, "frames": list(frames)}
    if t is not None:
        e["time_us"] = t
    return e


def segment(device, blocks):
    """One segment tiling ``blocks`` ((address, size, requested, state), in address order)."""
    start = blocks[0][0]
    return {
        "device": device,
        "address": start,
        "total_size": sum(b[1] for b in blocks),
        "stream": 0,
        "segment_type": "large",
        "is_expandable": False,
        "frames": [],
        "blocks": [{"address": a, "size": s, "requested_size": r, "state": st, "frames": []} for a, s, r, st in blocks],
    }


def pickled(data) -> bytes:
    raw = pickle.dumps(data, protocol=4)
    assert not {op.name for op, _, _ in pickletools.genops(raw)} & {"GLOBAL", "STACK_GLOBAL", "REDUCE", "INST", "OBJ"}
    return raw


def walk(data):
    """Live bytes per device and in total, the obvious way: each device in its trace's order (an entry never
    before the one above it, whatever its ``time_us``), devices merged by time. A free counts at
    ``free_completed``; the baseline is the live blocks of the segments the trace did not allocate plus the
    blocks the trace frees without allocating."""
    moves, baseline = [], {}
    for d, trace in enumerate(data["device_traces"]):
        allocated, base, clock = set(), 0, -np.inf
        for i, e in enumerate(trace):
            clock = max(clock, e["time_us"])
            if e["action"] == "alloc":
                allocated.add(e["addr"])
                moves.append((clock, d, i, e["size"]))
            elif e["action"] == "free_completed":
                if e["addr"] in allocated:
                    allocated.remove(e["addr"])
                else:
                    base += e["size"]
                moves.append((clock, d, i, -e["size"]))
        live = [b for s in data["segments"] if s["device"] == d for b in s["blocks"]]
        baseline[d] = base + sum(
            b["requested_size"] for b in live if b["state"] == "active_allocated" and b["address"] not in allocated
        )
    moves.sort()
    now, peak_dev = dict(baseline), dict(baseline)
    totals = [sum(now.values())]
    for _, d, _, delta in moves:
        now[d] += delta
        peak_dev[d] = max(peak_dev[d], now[d])
        totals.append(sum(now.values()))
    return {"peak": max(totals), "at": totals.index(max(totals)) - 1, "baseline": baseline, "peak_by_device": peak_dev}


def jittery(seed):
    """Two or three devices whose ``time_us`` sometimes steps back a little (threads reading the clock), with
    frees completed late, blocks from before the trace freed in it, and segments that agree with the trace."""
    rng = np.random.default_rng(seed)
    traces, segments = [], []
    for d in range(int(rng.integers(2, 4))):
        blocks, trace, live, t = {}, [], [], 0  # blocks: address -> [size, requested, state]
        top = [0x7F00_0000_0000 + d * (1 << 40)]

        def new(nbytes, blocks=blocks, top=top):
            addr, size = top[0], 512 * -(-nbytes // 512)
            top[0] += size
            blocks[addr] = [size, nbytes, "active_allocated"]
            return addr

        live += [new(int(rng.integers(1, 8 * MiB))) for _ in range(int(rng.integers(0, 3)))]  # before the trace
        for _ in range(int(rng.integers(1, 40))):
            t += int(rng.integers(0, 50))
            stamp = t - int(rng.integers(1, 30)) if rng.random() < 0.25 else t  # jitter: a step back in time
            if live and rng.random() < 0.45:
                addr = live.pop(int(rng.integers(len(live))))
                trace.append(entry("free_requested", addr, blocks[addr][1], stamp))
                trace.append(entry("free_completed", addr, blocks[addr][1], stamp + int(rng.integers(0, 3))))
                blocks[addr][2] = "inactive"
            else:
                nbytes = int(rng.integers(1, 16 * MiB))
                addr = new(nbytes)
                live.append(addr)
                trace.append(entry("alloc", addr, nbytes, stamp))
        traces.append(trace)
        if blocks:
            segments.append(
                segment(d, [(a, s, r if st != "inactive" else 0, st) for a, (s, r, st) in sorted(blocks.items())])
            )
    return {"segments": segments, "device_traces": traces}


# ---- the reader ---------------------------------------------------------------------------------------------------
def test_a_step_back_in_time_keeps_the_trace_order_of_its_device():
    # cuda:0 completes a free with a time_us before its alloc's: sorting by time would free the block before it
    # exists, take it for one allocated before the trace, and disagree with the segments
    a, b = 0x7F00_0000_0000, 0x7F10_0000_0000
    data = {
        "segments": [segment(0, [(a, 4 * MiB, 0, "inactive")]), segment(1, [(b, 2 * MiB, 0, "inactive")])],
        "device_traces": [
            [
                entry("alloc", a, 4 * MiB, 100),
                entry("free_requested", a, 4 * MiB, 101),
                entry("free_completed", a, 4 * MiB, 99),
            ],
            [entry("alloc", b, 2 * MiB, 50), entry("free_completed", b, 2 * MiB, 200)],
        ],
    }
    tl = read_snapshot(pickled(data))
    assert tl.baseline_by_device == {"cuda:0": 0, "cuda:1": 0}
    assert "unaccounted_bytes" not in tl.meta
    assert tl.peak_by_device() == {"cuda:0": 4 * MiB, "cuda:1": 2 * MiB} and tl.peak_bytes == 6 * MiB
    assert np.all(np.diff(tl.time) >= 0)
    assert tl.on_device("cuda:0").column("action").tolist() == [0, 1]  # the alloc, then its free


@pytest.mark.parametrize("seed", range(30))
def test_jittery_clocks_on_several_devices_peak_where_the_walk_peaks(seed):
    data = jittery(seed)
    tl = read_snapshot(pickled(data))
    ref = walk(data)
    assert "unaccounted_bytes" not in tl.meta
    assert tl.peak_bytes == ref["peak"] and tl.peak_index == ref["at"]
    assert tl.peak_by_device() == {f"cuda:{d}": v for d, v in ref["peak_by_device"].items()}
    assert tl.baseline_by_device == {f"cuda:{d}": v for d, v in ref["baseline"].items()}
    assert tl.meta["trace_entries"] == {f"cuda:{d}": len(t) for d, t in enumerate(data["device_traces"])}


@pytest.mark.parametrize(
    ("stack", "phase"),
    [
        ([("/venv/accelerate/optimizer.py", "step"), ("/src/train.py", "main")], "optimizer"),
        ([("/venv/transformers/optimization.py", "step"), ("/src/train.py", "main")], "optimizer"),
        ([("/venv/bitsandbytes/optim/optimizer.py", "update_step"), ("/src/train.py", "main")], "optimizer"),
        ([("/src/scheduler.py", "step"), ("/src/train.py", "main")], "other"),  # a step of something else
        ([("/src/optimizer_utils.py", "zero_grad"), ("/src/train.py", "main")], "other"),
    ],
)
def test_an_optimizer_step_outside_torch_optim_is_the_optimizer_phase(stack, phase):
    frames = [{"filename": f, "line": 10 + i, "name": n} for i, (f, n) in enumerate(stack)]
    data = {"segments": [], "device_traces": [[entry("alloc", 0x1000, 4096, 1, frames)]]}
    assert PHASES[read_snapshot(pickled(data)).column("phase")[0]] == phase


# ---- the command line -------------------------------------------------------------------------------------------
def crash_shaped():
    """Device 0's trace holds a marker alone; device 1's one free of a block from before the trace."""
    a, b = 0x7F00_0000_0000, 0x7F10_0000_0000
    return {
        "segments": [
            segment(0, [(a, 4 * MiB, 4 * MiB, "active_allocated"), (a + 4 * MiB, 2 * MiB, 0, "inactive")]),
            segment(1, [(b, 3 * MiB, 0, "inactive"), (b + 3 * MiB, 3 * MiB, 0, "inactive")]),
        ],
        "device_traces": [[entry("snapshot", 0, 0, 100)], [entry("free_completed", b, 3 * MiB, 50)]],
    }


def inspect(capsys, tmp_path, data, *args):
    path = tmp_path / "snapshot.pickle"
    path.write_bytes(pickled(data))
    code = main(["inspect", str(path), *args])
    out, err = capsys.readouterr()
    assert code == 0 and "Traceback" not in err, err
    return out


def rows(out):
    """The summary table as {label: value} (two or more spaces between them)."""
    table = {}
    for line in out.split("\n\n")[1].splitlines():
        label, _, value = line.strip().partition("  ")
        table[label] = value.strip()
    return table


def test_a_peak_no_event_reached_is_called_the_baseline_without_a_time(capsys, tmp_path):
    data = crash_shaped()
    ref = walk(data)
    assert ref["at"] == -1 and ref["peak_by_device"] == ref["baseline"] == {0: 4 * MiB, 1: 3 * MiB}
    table = rows(inspect(capsys, tmp_path, data))
    assert table["peak at"] == "before the trace (its baseline: memory never rose above it)"
    assert (
        table["peak cuda:0"]
        == f"4.00 MiB ({4 * MiB:,} B) before the trace (its baseline: no allocation or free on this device)"
    )
    assert (
        table["peak cuda:1"] == f"3.00 MiB ({3 * MiB:,} B) before the trace (its baseline: memory never rose above it)"
    )
    summary = json.loads(inspect(capsys, tmp_path, data, "--json"))
    assert summary["peak_index"] == -1
    assert {d: (v["peak_index"], v["peak_bytes"]) for d, v in summary["by_device"].items()} == {
        f"cuda:{d}": (-1, v) for d, v in ref["peak_by_device"].items()
    }
    assert summary["trace_entries"] == {"cuda:0": 1, "cuda:1": 1}


def test_a_peak_an_event_reached_keeps_its_time(capsys, tmp_path):
    a = 0x7F00_0000_0000
    data = {
        "segments": [segment(0, [(a, 4 * MiB, 0, "inactive")])],
        "device_traces": [[entry("alloc", a, 4 * MiB, 1_000_000), entry("free_completed", a, 4 * MiB, 3_500_000)]],
    }
    table = rows(inspect(capsys, tmp_path, data))
    assert table["peak at"] == "0 s, phase other"  # times count from the first event
    data["device_traces"][0].insert(0, entry("alloc", a + 4 * MiB, 512, 0))
    data["segments"][0]["blocks"].append({"address": a + 4 * MiB, "size": 512, "requested_size": 512,
                                          "state": "active_allocated", "frames": []})  # fmt: skip
    assert rows(inspect(capsys, tmp_path, data))["peak at"] == "1 s, phase other"


@pytest.mark.parametrize(
    ("traces", "segments", "message"),
    [
        ([[entry("snapshot", 0, 0, 1), entry("segment_alloc", 0x1000, 2 * MiB, 2)]], True,
         "no allocation or free in the trace: it holds 2 other entries (markers, segment actions, out-of-memory"),
        ([[{"action": "oom", "size": 5 * MiB, "device_free": 0, "stream": 0, "time_us": 3}]], True,
         "no allocation or free in the trace: it holds 1 other entry (markers"),
        ([[], []], True, "no trace: this file holds the allocator's segments only"),
        ([], False, "this file holds neither a trace nor segments"),
    ],
)  # fmt: skip
def test_a_file_without_events_says_what_it_holds(capsys, tmp_path, traces, segments, message):
    blocks = [(0x1000, 2 * MiB, 2 * MiB, "active_allocated")]
    data = {"segments": [segment(0, blocks)] if segments else [], "device_traces": traces}
    out = inspect(capsys, tmp_path, data)
    assert message in out
    others = {"no allocation or free in the trace", "no trace:", "neither a trace nor segments"}
    assert not [m for m in others if m in out and m not in message]


# ---- plots ----------------------------------------------------------------------------------------------------------
def lines(fig):
    return {tr.name: (np.asarray(tr.x, dtype=float), np.asarray(tr.y, dtype=float), tr.xaxis) for tr in fig.data}


def test_a_device_without_events_holds_its_baseline_across_the_window():
    a, b = 0x7F00_0000_0000, 0x7F10_0000_0000
    data = {
        "segments": [
            segment(0, [(a, 4 * MiB, 4 * MiB, "active_allocated")]),
            segment(1, [(b, 2 * MiB, 0, "inactive")]),
        ],
        "device_traces": [
            [entry("snapshot", 0, 0, 0)],
            [entry("alloc", b, 2 * MiB, 1_000_000), entry("free_completed", b, 2 * MiB, 3_000_000)],
        ],
    }
    ref = walk(data)
    fig = plots.timeline_figure(read_snapshot(pickled(data)), unit="MiB")
    drawn = lines(fig)
    x0, y0, axis0 = drawn["total cuda:0"]
    assert axis0 == "x" and x0[0] == 0 and x0[-1] == 2.0  # the window: first to last event, in seconds
    assert set(y0) == {ref["baseline"][0] / MiB}
    x1, y1, axis1 = drawn["total cuda:1"]
    assert axis1 == "x2" and x1[-1] == 2.0 and y1.max() == ref["peak_by_device"][1] / MiB
    notes = [a.text for a in fig.layout.annotations if a.text.startswith("peak")]
    assert notes[0] == "peak 4.00 MiB (4,194,304 B)<br>its baseline (live before the trace): never rose above it"
    assert notes[1].endswith("at 0 s")


def test_a_snapshots_baseline_is_drawn_and_named_per_device():
    a, b = 0x7F00_0000_0000, 0x7F10_0000_0000
    data = {
        "segments": [
            segment(0, [(a, 6 * MiB, 6 * MiB, "active_allocated"), (a + 6 * MiB, MiB, 0, "inactive")]),
            segment(1, [(b, 3 * MiB, 3 * MiB, "active_allocated"), (b + 3 * MiB, MiB, MiB, "active_allocated")]),
        ],
        "device_traces": [
            [entry("alloc", a + 6 * MiB, MiB, 0), entry("free_completed", a + 6 * MiB, MiB, 10)],
            [entry("alloc", b + 3 * MiB, MiB, 5)],
        ],
    }
    ref = walk(data)
    assert ref["baseline"] == {0: 6 * MiB, 1: 3 * MiB}
    fig = plots.timeline_figure(read_snapshot(pickled(data)))
    dashed = [tr for tr in fig.data if tr.name == "baseline (live before the trace)"]
    assert [(tr.xaxis, list(tr.y)) for tr in dashed] == [("x", [6.0, 6.0]), ("x2", [3.0, 3.0])]
    assert [tr.showlegend for tr in dashed] == [True, False] and all(tr.line.dash == "dash" for tr in dashed)
    assert all(np.allclose(tr.x, [0.0, 1e-05]) for tr in dashed)  # the window: first to last event
    # a tracked step (no snapshot) has no such line: its baseline has its categories
    tracked = read_snapshot(pickled(data))
    tracked.meta["source"] = "tracker"
    assert not [tr for tr in plots.timeline_figure(tracked).data if tr.name.startswith("baseline")]


def test_a_single_moment_is_not_centred_on_an_axis_from_minus_one():
    a = 0x7F00_0000_0000
    data = {
        "segments": [segment(0, [(a, 2 * MiB, 2 * MiB, "active_allocated")])],
        "device_traces": [[entry("alloc", a, 2 * MiB, 7)]],
    }
    fig = plots.timeline_figure(read_snapshot(pickled(data)))
    assert tuple(fig.layout.xaxis.range) == (0.0, 1.0)
    two = dict(data, device_traces=[[entry("alloc", a, MiB, 7), entry("alloc", a + MiB, MiB, 9)]])
    assert plots.timeline_figure(read_snapshot(pickled(two))).layout.xaxis.range is None


def test_untimed_devices_are_not_drawn_past_their_own_events():
    # torch 2.1 traces have no time_us: the devices' traces are laid end to end, so drawing cuda:0's level on
    # beside cuda:1's events would claim moments that were never measured together
    a, b = 0x7F00_0000_0000, 0x7F10_0000_0000
    data = {
        "segments": [
            segment(0, [(a, MiB, MiB, "active_allocated")]),
            segment(1, [(b, 2 * MiB, 2 * MiB, "active_allocated")]),
        ],
        "device_traces": [[entry("alloc", a, MiB)], [entry("alloc", b, MiB), entry("alloc", b + MiB, MiB)]],
    }
    data["segments"][1]["blocks"] = [
        {"address": b, "size": MiB, "requested_size": MiB, "state": "active_allocated", "frames": []},
        {"address": b + MiB, "size": MiB, "requested_size": MiB, "state": "active_allocated", "frames": []},
    ]
    tl = read_snapshot(pickled(data))
    assert tl.meta["time_unit"] == "event" and tl.time.tolist() == [0, 1, 2]
    drawn = lines(plots.timeline_figure(tl))
    assert drawn["total cuda:0"][0].tolist() == [0, 0] and drawn["total cuda:1"][0].tolist() == [0, 1, 2]


def test_the_top_allocations_say_the_baseline_is_not_among_them(capsys, tmp_path):
    # 13 GiB of weights allocated before the trace are no trace entry: the list must not pass for everything
    a, b = 0x7F00_0000_0000, 0x7F10_0000_0000
    data = {
        "segments": [
            segment(0, [(a, 13 << 30, 13 << 30, "active_allocated"), (a + (13 << 30), MiB, 0, "inactive")]),
            segment(1, [(b, 2 * MiB, 0, "inactive")]),
        ],
        "device_traces": [
            [entry("alloc", a + (13 << 30), MiB, 1), entry("free_completed", a + (13 << 30), MiB, 2)],
            [entry("alloc", b, 2 * MiB, 3), entry("free_completed", b, 2 * MiB, 4)],
        ],
    }
    ref = walk(data)
    out = inspect(capsys, tmp_path, data)
    cuda0, cuda1 = out.split("allocations live at the peak on cuda:")[1:]
    assert "not listed: blocks allocated before the trace began (13.00 GiB at its start)" in cuda0
    assert ref["baseline"] == {0: 13 << 30, 1: 0} and "not listed" not in cuda1


def test_the_site_column_is_short_for_native_frames_with_a_file_and_paths_with_spaces(capsys, tmp_path):
    native = [
        {"filename": "??", "line": 0, "name": "torch::unwind::unwind()"},
        {"filename": "/pytorch/aten/src/ATen/native/cuda/Blas.cpp", "line": 345,
         "name": "at::native::addmm_out_cuda_impl(at::Tensor&, at::Tensor const&, at::Tensor const&)"},
        {"filename": "??", "line": 0, "name": "torch::autograd::Engine::thread_main(GraphTask const&)"},
    ]  # fmt: skip
    spaced = [{"filename": "C:\\Program Files\\app\\model.py", "line": 12, "name": "forward"}]
    data = {
        "segments": [],
        "device_traces": [[entry("alloc", 0x1000, 8 * MiB, 1, native), entry("alloc", 0x900000, 4 * MiB, 2, spaced)]],
    }
    out = inspect(capsys, tmp_path, data)
    table = out.split("op, then the innermost frame):\n")[1].splitlines()
    assert table[0].split("backward")[1].strip() == "Blas.cpp:345 at::native::addmm_out_cuda_impl()"
    assert table[1].split("forward", 1)[1].strip() == "model.py:12 forward"


def oom(size, free, t=None):
    e = {"action": "oom", "size": size, "device_free": free, "stream": 0, "frames": []}  # torch logs no address
    if t is not None:
        e["time_us"] = t
    return e


@pytest.mark.parametrize("timed", [True, False])
def test_an_out_of_memory_error_is_named_with_its_device_and_what_was_asked(capsys, tmp_path, timed):
    a, b = 0x7F00_0000_0000, 0x7F10_0000_0000
    t = (lambda us: us) if timed else (lambda us: None)
    data = {
        "segments": [
            segment(0, [(a, 2 * MiB, 2 * MiB, "active_allocated")]),
            segment(1, [(b, 70 << 30, 70 << 30, "active_allocated")]),
        ],
        "device_traces": [
            [entry("alloc", a, 2 * MiB, t(1_000_000))],
            [entry("alloc", b, 70 << 30, t(2_000_000)), oom(20 << 30, 512 * MiB, t(4_500_000))],
        ],
    }
    tl = read_snapshot(pickled(data))
    when = 3.5 if timed else None  # seconds since the first event, 1 s
    assert tl.meta["out_of_memory"] == [
        {"device": "cuda:1", "requested_bytes": 20 << 30, "device_free_bytes": 512 * MiB, "time": when}
    ]
    assert len(tl) == 2 and tl.peak_by_device() == {"cuda:0": 2 * MiB, "cuda:1": 70 << 30}  # the oom is no event
    table = rows(inspect(capsys, tmp_path, data))
    expected = "asked for 20.00 GiB with 512.00 MiB free in CUDA" + (", at 3.5 s" if timed else "")
    assert table["out of memory cuda:1"] == expected and "out of memory cuda:0" not in table
    summary = json.loads(inspect(capsys, tmp_path, data, "--json"))
    assert summary["out_of_memory"] == tl.meta["out_of_memory"]


def test_the_plot_marks_an_out_of_memory_error_on_its_device_and_reaches_it():
    a, b = 0x7F00_0000_0000, 0x7F10_0000_0000
    first_us, oom_us = 1_000_000, 6_000_000
    data = {
        "segments": [
            segment(0, [(a, 2 * MiB, 2 * MiB, "active_allocated")]),
            segment(1, [(b, 70 << 30, 70 << 30, "active_allocated")]),
        ],
        "device_traces": [
            [entry("alloc", a, 2 * MiB, first_us)],
            [entry("alloc", b, 70 << 30, 2_000_000), oom(20 << 30, 512 * MiB, oom_us)],
        ],
    }
    fig = plots.timeline_figure(read_snapshot(pickled(data)), unit="GiB")
    when = (oom_us - first_us) / 1e6
    red = [s for s in fig.layout.shapes if s.line.dash == "dot"]
    assert [(s.x0, s.x1, s.xref) for s in red] == [(when, when, "x2")]  # on cuda:1's panel
    assert "out of memory: asked for 20.00 GiB" in [a.text for a in fig.layout.annotations]
    drawn = lines(fig)
    assert drawn["total cuda:0"][0][-1] == drawn["total cuda:1"][0][-1] == when  # memory held until the error
    untimed = {
        **data,
        "device_traces": [[{k: v for k, v in e.items() if k != "time_us"} for e in t] for t in data["device_traces"]],
    }
    assert not [s for s in plots.timeline_figure(read_snapshot(pickled(untimed))).layout.shapes if s.line.dash == "dot"]
