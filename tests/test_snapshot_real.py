"""Snapshots in the shapes real GPU runs write (torch 2.1-2.8): several devices, a device with only markers, no
``time_us``, C++-only stacks, segments only, expandable segments. Every fixture is plain data written in torch's
schema and pickled without a single global; peaks are checked against an independent walk of the trace below.
"""

import json
import pickle
import pickletools

import numpy as np
import pytest

from memkit import plots
from memkit.cli import main
from memkit.memory import CATEGORIES, PHASES
from memkit.memory.snapshot import NO_SITE, SnapshotError, read_snapshot

GiB, MiB = 1 << 30, 1 << 20
SEGMENT = 2 << 20


# ---- a GPU's allocator, as torch records it ---------------------------------------------------------------------
def frame(filename, name, line=0):
    return {"filename": filename, "line": line, "name": name}


class Gpu:
    """One device: blocks allocated before the trace began, then trace entries; ``segments()`` is what the
    allocator holds at the end (blocks tile one segment per device, freed blocks stay as inactive)."""

    def __init__(self, index, *, times=True, expandable=False):
        self.index, self.times, self.expandable = index, times, expandable
        self.base = 0x7F00_0000_0000 + index * (1 << 40)
        self.top, self.trace, self.blocks = self.base, [], {}  # address -> [size, requested, state]

    def _new(self, nbytes):
        addr, size = self.top, max(512, -(-nbytes // 512) * 512)
        self.top += size
        self.blocks[addr] = [size, nbytes, "active_allocated"]
        return addr

    def entry(self, action, addr, size, t, frames=()):
        e = {"action": action, "addr": addr, "size": size, "stream": 0, "frames": list(frames)}
        if self.times:
            e["time_us"] = t
        self.trace.append(e)

    def before(self, nbytes):
        """A block allocated before the trace began (no entry)."""
        return self._new(nbytes)

    def alloc(self, nbytes, t, frames=()):
        addr = self._new(nbytes)
        self.entry("alloc", addr, nbytes, t, frames)
        return addr

    def free(self, addr, t, *, completed_at=None, frames=()):
        nbytes = self.blocks[addr][1]
        self.entry("free_requested", addr, nbytes, t, frames)
        if completed_at is not False:
            self.entry("free_completed", addr, nbytes, t if completed_at is None else completed_at, frames)
        self.blocks[addr][2] = "inactive"

    def marker(self, t, action="snapshot"):
        self.entry(action, 0, 0, t)
        if action == "oom":  # torch logs no address for an OOM, and the device's free bytes
            del self.trace[-1]["addr"]
            self.trace[-1].update(size=20 * GiB, device_free=512 * MiB)

    def segments(self):
        end = self.base + max(SEGMENT, -(-(self.top - self.base) // SEGMENT) * SEGMENT)
        blocks = [
            {"address": a, "size": s, "requested_size": r if st != "inactive" else 0, "state": st, "frames": []}
            for a, (s, r, st) in sorted(self.blocks.items())
        ]
        if end > self.top:
            blocks.append({"address": self.top, "size": end - self.top, "requested_size": 0, "state": "inactive"})
        if not self.blocks:
            return []
        live = [b for b in blocks if b["state"] == "active_allocated"]
        return [
            {
                "device": self.index,
                "address": self.base,
                "total_size": end - self.base,
                "allocated_size": sum(b["size"] for b in live),
                "active_size": sum(b["size"] for b in live),
                "requested_size": sum(b["requested_size"] for b in live),
                "stream": 0,
                "segment_type": "large",
                "segment_pool_id": (0, 0),
                "is_expandable": self.expandable,
                "frames": [],
                "blocks": blocks,
            }
        ]


def snapshot_of(gpus, *, n_devices=None, extra=True):
    n = n_devices or max(g.index for g in gpus) + 1
    traces = [[] for _ in range(n)]
    for g in gpus:
        traces[g.index] = g.trace
    data = {"segments": [s for g in gpus for s in g.segments()], "device_traces": traces}
    if extra:  # torch 2.5+ / 2.6+
        data["allocator_settings"] = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True", "max_split_size": -1}
        data["external_annotations"] = [{"device": 0, "stage": "START", "name": "step", "time_us": 1}]
    return data


def pickled(data) -> bytes:
    """The fixture as a file: plain data only, not one global (so it can run nothing)."""
    raw = pickle.dumps(data, protocol=4)
    assert not {op.name for op, _, _ in pickletools.genops(raw)} & {"GLOBAL", "STACK_GLOBAL", "REDUCE", "INST", "OBJ"}
    return raw


# ---- the independent walk --------------------------------------------------------------------------------------
def walk(data):
    """Total and per-device live bytes, from the trace and segments alone, the obvious way.

    A device counts a free at ``free_completed`` (at ``free_requested`` if its trace has no completions). Its
    baseline is every live block of the segments that the trace did not allocate, plus each freed block that
    the trace never allocated. Devices share one time line by ``time_us`` (by index when a trace has none).
    """
    traces = data["device_traces"]
    events, baseline = [], {}
    for d, trace in enumerate(traces):
        if not trace:
            continue
        completes = any(e["action"] == "free_completed" for e in trace)
        free = "free_completed" if completes else "free_requested"
        allocated, base = set(), 0
        for i, e in enumerate(trace):
            if e["action"] == "alloc":
                allocated.add(e["addr"])
                events.append((e.get("time_us"), d, i, e["size"]))
            elif e["action"] == free:
                if e["addr"] in allocated:
                    allocated.discard(e["addr"])
                else:
                    base += e["size"]
                events.append((e.get("time_us"), d, i, -e["size"]))
        baseline[d] = base
        baseline[d] += sum(
            b["requested_size"]
            for s in data["segments"]
            if s["device"] == d
            for b in s["blocks"]
            if b["state"] == "active_allocated" and b["address"] not in allocated
        )
    for s in data["segments"]:
        if s["device"] not in baseline:
            baseline[s["device"]] = sum(b["requested_size"] for b in s["blocks"] if b["state"] == "active_allocated")
    if all(t is not None for t, *_ in events):
        events.sort(key=lambda e: (e[0], e[1], e[2]))
    live = dict(baseline)
    total = [sum(live.values())]
    peak_dev = dict(live)
    for _, d, _, delta in events:
        live[d] += delta
        peak_dev[d] = max(peak_dev[d], live[d])
        total.append(sum(live.values()))
    first_max = total.index(max(total)) - 1  # the event after which the total peaked (-1: never rose)
    return {"peak": max(total), "end": total[-1], "peak_by_device": peak_dev, "baseline": baseline, "at": first_max}


def check_against_walk(tl, data):
    ref = walk(data)
    assert tl.peak_bytes == ref["peak"] and tl.peak_index == ref["at"]
    assert tl.end_bytes == ref["end"]
    names = {int(name.split(":")[1]): name for name in tl.devices}
    assert tl.peak_by_device() == {names[d]: v for d, v in sorted(ref["peak_by_device"].items())}
    assert tl.baseline_by_device == {names[d]: v for d, v in sorted(ref["baseline"].items())}
    assert "unaccounted_bytes" not in tl.meta
    return ref


# ---- fixtures: the shapes of issue 12 -------------------------------------------------------------------------
def three_gpus():
    """Three GPUs whose peaks fall at different moments: the sum at one moment is no GPU's figure."""
    g0, g1, g2 = Gpu(0), Gpu(1), Gpu(2)
    for g in (g0, g1, g2):
        g.before(13 * GiB)  # the weights, live before the trace
    a = g0.alloc(20 * GiB, 10)
    g0.free(a, 20, completed_at=25)
    b = g1.alloc(30 * GiB, 30)
    c = g2.alloc(5 * GiB, 5)
    g1.free(b, 40)
    g2.free(c, 50)
    g0.marker(60)
    return snapshot_of([g0, g1, g2])


def test_several_gpus_are_peaks_per_device_and_a_total_that_says_it_sums():
    data = three_gpus()
    tl = read_snapshot(pickled(data))
    ref = check_against_walk(tl, data)
    assert tl.devices == ["cuda:0", "cuda:1", "cuda:2"]
    assert tl.peak_by_device() == {"cuda:0": 33 * GiB, "cuda:1": 43 * GiB, "cuda:2": 18 * GiB}
    assert tl.peak_bytes == ref["peak"] == 39 * GiB + 30 * GiB + 5 * GiB > max(tl.peak_by_device().values())
    assert tl.summary()["peak_by_device"] == tl.peak_by_device()
    one = tl.on_device("cuda:1")
    assert one.peak_bytes == 43 * GiB and one.devices == ["cuda:1"]
    assert [a["bytes"] for a in one.top_allocations(2)] == [30 * GiB]
    assert {a["device"] for a in tl.top_allocations(10)} == {"cuda:1", "cuda:2"}


def test_a_device_with_only_a_marker_beside_one_with_a_lone_free_reads():
    # the crash of issue 12: device 0's trace holds only a marker, device 1's a single free_completed
    g0, g1 = Gpu(0), Gpu(1)
    g0.before(4 * MiB)
    old = g1.before(3 * MiB)
    g0.marker(100)
    g1.free(old, 50)
    g1.trace = [e for e in g1.trace if e["action"] == "free_completed"]
    data = snapshot_of([g0, g1])
    tl = read_snapshot(pickled(data))
    check_against_walk(tl, data)
    assert tl.devices == ["cuda:0", "cuda:1"] and len(tl) == 1
    assert tl.baseline_by_device == {"cuda:0": 4 * MiB, "cuda:1": 3 * MiB}
    assert tl.peak_by_device() == {"cuda:0": 4 * MiB, "cuda:1": 3 * MiB}


@pytest.mark.parametrize("actions", [["snapshot"], ["segment_alloc"], ["segment_alloc", "snapshot", "oom"]])
def test_a_trace_of_markers_and_segment_actions_alone_reads_as_no_events(actions):
    g = Gpu(0)
    g.before(1000)
    for i, action in enumerate(actions):
        g.marker(i, action)
    data = snapshot_of([g])
    tl = read_snapshot(pickled(data))
    check_against_walk(tl, data)
    assert len(tl) == 0 and tl.peak_bytes == tl.baseline_bytes == 1000 and tl.peak_index == -1


def torch21():
    """torch 2.1: no ``time_us``, no allocator_settings or external_annotations; two devices."""
    g0, g1 = Gpu(0, times=False), Gpu(1, times=False)
    g0.before(100 * MiB)
    x = g0.alloc(300 * MiB, None)
    g1.alloc(50 * MiB, None)
    y = g0.alloc(200 * MiB, None)
    g0.free(x, None)
    g0.free(y, None)
    return snapshot_of([g0, g1], extra=False)


def test_a_trace_without_times_is_ordered_by_event_and_says_so():
    data = torch21()
    tl = read_snapshot(pickled(data))
    check_against_walk(tl, data)
    assert tl.meta["time_unit"] == "event"
    assert tl.time.tolist() == list(range(len(tl)))
    assert tl.on_device("cuda:0").peak_bytes == 600 * MiB


def backward_stack(op="at::_ops::mm::call(at::Tensor const&, at::Tensor const&)"):
    """What the autograd engine's thread records: C++ frames only, innermost first."""
    return [
        frame("??", "torch::unwind::unwind()"),
        frame("??", "torch::CapturedTraceback::gather(bool, bool, bool)"),
        frame("/pytorch/c10/cuda/CUDACachingAllocator.cpp", "c10::cuda::CUDACachingAllocator::Native::malloc", 1234),
        frame("??", "at::detail::empty_generic(...)"),
        frame("??", "at::native::empty_cuda(...)"),
        *([frame("??", op)] if op else []),
        *([frame("??", "torch::autograd::generated::MmBackward0::apply(std::vector<at::Tensor>&&)")] if op else []),
        frame("??", "torch::autograd::Engine::thread_main(std::shared_ptr<torch::autograd::GraphTask> const&)"),
        frame("thread48.o", "execute_native_thread_routine"),
        frame("??", "start_thread"),
        frame("??", "clone"),
    ]


def python_stack(*names):
    """Python frames, innermost first."""
    return [frame(f, n, 10 + i) for i, (f, n) in enumerate(names)]


def test_stacks_give_the_nearest_meaningful_frame_and_the_phases_they_name():
    g = Gpu(0)
    engine_only = [f for f in backward_stack(op=None) if "Engine" not in f["name"]]
    stacks = {
        "forward": python_stack(("/src/model.py", "forward"), ("/torch/nn/modules/module.py", "_call_impl")),
        "backward": backward_stack(),
        "optimizer": python_stack(("/torch/optim/adamw.py", "_multi_tensor_adamw"), ("/src/train.py", "main")),
        "foreach": [frame("??", "at::_ops::_foreach_add::call(...)"), frame("??", "execute_native_thread_routine")],
        "nothing": engine_only,
        "plain": python_stack(("/src/train.py", "main"), ("/src/train.py", "<module>")),
    }
    for i, stack in enumerate(stacks.values()):
        g.alloc(1000 * (i + 1), i, frames=stack)
    data = snapshot_of([g])
    tl = read_snapshot(pickled(data))
    check_against_walk(tl, data)
    rows = {a["bytes"] // 1000 - 1: a for a in tl.top_allocations(10)}
    by = {name: rows[i] for i, name in enumerate(stacks)}
    assert [by[k]["phase"] for k in stacks] == ["forward", "backward", "optimizer", "optimizer", "other", "other"]
    assert by["forward"]["frame"].splitlines()[-1] == "/src/model.py:10 forward"
    site = by["backward"]["frame"].splitlines()[-1]
    assert site == "??:0 at::_ops::mm::call(at::Tensor const&, at::Tensor const&)"  # not unwind(), not thread48.o
    assert all(".o:" not in (a["frame"] or "") for a in rows.values())
    assert by["nothing"]["frame"] == NO_SITE  # allocator and thread internals only
    assert {a["category"] for a in rows.values()} == {"unknown"}  # phases are read, categories never guessed


def test_a_stack_of_allocator_internals_alone_says_it_has_no_site():
    g = Gpu(0)
    g.alloc(512, 1, frames=[f for f in backward_stack(op=None) if "Engine" not in f["name"]])
    tl = read_snapshot(snapshot_of([g]))
    assert tl.top_allocations(1)[0]["frame"] == NO_SITE


def segments_only():
    g0, g1 = Gpu(0), Gpu(1)
    a = g0.before(6 * MiB)
    g0.before(3 * MiB)
    g0.blocks[a][2] = "inactive"
    g0.blocks[a][1] = 0
    g1.before(1 * GiB)
    pending = g1.before(100 * MiB)
    g1.blocks[pending][2] = "active_pending_free"
    return [s for g in (g0, g1) for s in g.segments()]


@pytest.mark.parametrize("shape", ["bare list", "empty traces"])
def test_segments_only_files_show_their_segments_and_blocks(shape):
    segs = segments_only()
    data = segs if shape == "bare list" else {"segments": segs, "device_traces": [[], []]}
    tl = read_snapshot(pickled(data))
    assert len(tl) == 0 and tl.devices == ["cuda:0", "cuda:1"]
    assert tl.baseline_by_device == {"cuda:0": 3 * MiB, "cuda:1": GiB + 100 * MiB}
    seg = tl.meta["segments"]
    assert seg["cuda:0"]["blocks"]["inactive"]["bytes"] == 6 * MiB + 5 * SEGMENT - 9 * MiB  # A, and the segment's tail
    assert seg["cuda:0"]["blocks"]["active_allocated"] == {"count": 1, "bytes": 3 * MiB}
    assert seg["cuda:1"]["blocks"]["active_pending_free"] == {"count": 1, "bytes": 100 * MiB}
    assert seg["cuda:0"]["largest_inactive_block"] == 6 * MiB
    blocks = seg["cuda:1"]["blocks_by_size"].values()
    assert sum(v for states in blocks for v in states.values()) == 2  # no tail: 1124 MiB fills the segment
    assert tl.meta["reserved_bytes"] == {d: seg[d]["reserved_bytes"] for d in seg}
    fig = plots.segments_figure(tl)
    bytes_bars = {tr.name: list(tr.x) for tr in fig.data if tr.orientation == "h"}
    assert bytes_bars["active_allocated"] == [3.0, 1024.0] and bytes_bars["active_pending_free"] == [0.0, 100.0]
    assert "reserved" in fig.layout.title.text


def test_expandable_segments_read_like_any_other():
    g = Gpu(0, expandable=True)
    g.marker(0, "segment_map")
    g.before(2 * GiB)
    a = g.alloc(3 * GiB, 1)
    g.marker(2, "segment_map")
    g.alloc(1 * GiB, 3)
    g.free(a, 4)
    g.marker(5, "segment_unmap")
    data = snapshot_of([g])
    tl = read_snapshot(pickled(data))
    check_against_walk(tl, data)
    assert tl.peak_bytes == 6 * GiB and tl.meta["segments"]["cuda:0"]["expandable_segments"] == 1


def test_what_the_reader_does_not_use_is_kept_in_meta():
    data = three_gpus()
    tl = read_snapshot(pickled(data))
    assert tl.meta["allocator_settings"] == data["allocator_settings"]
    assert tl.meta["external_annotations"] == data["external_annotations"]
    back = read_snapshot(tl.to_snapshot())  # and memkit writes them back
    assert back.meta["allocator_settings"] == data["allocator_settings"]
    assert back.peak_by_device() == tl.peak_by_device() and back.baseline_by_device == tl.baseline_by_device


def random_snapshot(seed):
    """Up to three devices of random allocs and frees (some delayed, some of blocks from before the trace)."""
    rng = np.random.default_rng(seed)
    times = rng.random() < 0.8
    gpus = [Gpu(d, times=times) for d in range(rng.integers(1, 4))]
    open_ = {g.index: [g.before(int(rng.integers(1, 1 << 20))) for _ in range(rng.integers(0, 4))] for g in gpus}
    skip_completed = {g.index: rng.random() < 0.2 for g in gpus}
    pending = []  # (time, gpu, addr, size): completions that another stream delays, logged in time order
    t = 0
    for _ in range(rng.integers(0, 60)):
        t += int(rng.integers(1, 100))
        for done in [p for p in pending if p[0] <= t]:
            pending.remove(done)
            done[1].entry("free_completed", done[2], done[3], done[0])
        g = gpus[rng.integers(len(gpus))]
        live = open_[g.index]
        if live and rng.random() < 0.45:
            addr = live.pop(rng.integers(len(live)))
            delayed = skip_completed[g.index] or rng.random() < 0.3
            g.free(addr, t, completed_at=False if delayed else None)
            if delayed and not skip_completed[g.index]:
                pending.append((t + int(rng.integers(1, 150)), g, addr, g.blocks[addr][1]))
        else:
            live.append(g.alloc(int(rng.integers(1, 1 << 24)), t))
    for time, g, addr, size in pending:  # completed after the last entry
        g.entry("free_completed", addr, size, time)
    return snapshot_of(gpus)


@pytest.mark.parametrize("seed", range(40))
def test_random_traces_peak_where_the_independent_walk_peaks(seed):
    data = random_snapshot(seed)
    raw = pickled(data)
    tl = read_snapshot(raw)
    if any(len(t) for t in data["device_traces"]) and not all("time_us" in e for t in data["device_traces"] for e in t):
        assert tl.meta["time_unit"] == "event"
    check_against_walk(tl, data)


# ---- plots and the command line -----------------------------------------------------------------------------------
def test_the_plot_draws_one_panel_per_device_and_an_event_axis_without_times():
    tl = read_snapshot(three_gpus())
    fig = plots.timeline_figure(tl, unit="GiB")
    totals = {tr.name: max(tr.y) for tr in fig.data if tr.name.startswith("total")}
    assert totals == {"total cuda:0": 33.0, "total cuda:1": 43.0, "total cuda:2": 18.0}
    assert "3 devices" in fig.layout.title.text and "74.00 GiB" in fig.layout.title.text
    assert [a.text for a in fig.layout.annotations if a.text.startswith("cuda")] == [
        "cuda:0: peak 33.00 GiB",
        "cuda:1: peak 43.00 GiB",
        "cuda:2: peak 18.00 GiB",
    ]
    old = plots.timeline_figure(read_snapshot(torch21()))
    layout = old.layout.to_plotly_json()
    titles = {ax.get("title", {}).get("text") for name, ax in layout.items() if name.startswith("xaxis")} - {None}
    assert titles == {"event (the trace has no times)"}
    assert all(" s<" not in a.text and not a.text.endswith(" s") for a in old.layout.annotations)
    assert any("at event" in a.text for a in old.layout.annotations)


def run_cli(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_inspect_shows_each_gpu_and_says_the_total_sums_them(capsys, tmp_path):
    path = tmp_path / "three.pickle"
    path.write_bytes(pickled(three_gpus()))
    code, out, err = run_cli(capsys, "inspect", str(path), "--top", "2")
    assert code == 0, err
    assert "peak (the 3 devices summed at one moment)" in out
    for device, peak in (("cuda:0", 33), ("cuda:1", 43), ("cuda:2", 18)):
        assert f"peak {device}" in out and f"{peak * GiB:,} B" in out
        assert f"allocations live at the peak on {device}" in out
    assert "cuda:1  30.00 GiB  unknown" in out  # the device column
    code, out, err = run_cli(capsys, "inspect", str(path), "--json")
    summary = json.loads(out)
    assert summary["peak_by_device"] == {"cuda:0": 33 * GiB, "cuda:1": 43 * GiB, "cuda:2": 18 * GiB}
    assert summary["peak_bytes_sums_devices"] is True and summary["by_device"]["cuda:1"]["peak_bytes"] == 43 * GiB
    assert set(CATEGORIES) >= set(summary["peak_by_category"]) and PHASES


def test_inspect_reads_the_crash_file_the_old_file_and_a_segments_only_file(capsys, tmp_path):
    g0, g1 = Gpu(0), Gpu(1)
    old = g1.before(3 * MiB)
    g0.marker(100)
    g1.free(old, 50)
    files = {"crash": snapshot_of([g0, g1]), "torch21": torch21(), "segments": segments_only()}
    for name, data in files.items():
        path = tmp_path / f"{name}.pickle"
        path.write_bytes(pickled(data))
        html = tmp_path / f"{name}.html"
        code, out, err = run_cli(capsys, "inspect", str(path), "--html", str(html))
        assert code == 0 and "Traceback" not in err, (name, err)
        assert html.stat().st_size > 1000
        if name == "torch21":
            assert out.split("peak at")[1].split()[0] == "event"
        if name == "segments":
            assert "no trace: this file holds the allocator's segments only" in out
            assert "cached, free" in out and "allocated" in out
            assert "Allocator segments" in html.read_text()


def test_a_crafted_fixture_is_still_refused():
    class Runs:
        def __reduce__(self):
            return (print, ("ran",))

    data = three_gpus()
    data["external_annotations"].append(Runs())
    with pytest.raises(SnapshotError, match="refused to load the global"):
        read_snapshot(pickle.dumps(data, protocol=4))


def test_a_baseline_split_must_add_up_and_name_known_devices():
    from memkit.memory import Timeline

    cols = {"time": [0.0], "action": [0], "bytes": [8], "category": [0], "phase": [0], "device": [1], "storage": [1]}
    tl = Timeline(cols, devices=["cuda:0", "cuda:1"], baseline_by_device={"cuda:1": {"parameter": 5}})
    assert tl.baseline_by_category["parameter"] == 5 and tl.baseline_by_device == {"cuda:0": 0, "cuda:1": 5}
    assert tl.peak_by_device() == {"cuda:0": 0, "cuda:1": 13}
    with pytest.raises(ValueError, match="not in devices"):
        Timeline(cols, devices=["cuda:0", "cuda:1"], baseline_by_device={"cuda:7": {"parameter": 5}})
    with pytest.raises(ValueError, match="sums to 5 bytes of 'parameter'"):
        Timeline(
            cols,
            devices=["cuda:0", "cuda:1"],
            baseline_by_category={"parameter": 6},
            baseline_by_device={"cuda:1": {"parameter": 5}},
        )
    with pytest.raises(KeyError, match="no device 'cuda:3'"):
        tl.on_device("cuda:3")


def test_damaged_fixtures_read_or_raise_a_snapshot_error_never_another():
    import copy
    import random

    g = Gpu(0)
    g.alloc(1000, 1, frames=backward_stack())
    bases = [three_gpus(), torch21(), {"segments": segments_only(), "device_traces": []}, snapshot_of([g])]
    bases += [random_snapshot(3), random_snapshot(7)]
    values = [None, "x", -1, 2**70, 1.5, [], {}, float("nan"), True]

    def paths(obj, path=()):
        yield path
        items = obj.items() if isinstance(obj, dict) else enumerate(obj[:6]) if isinstance(obj, list) else ()
        for key, value in items:
            yield from paths(value, (*path, key))

    def parent_of(obj, path):  # None once an earlier change has cut the path
        for key in path:
            inside = key in obj if isinstance(obj, dict) else isinstance(obj, list) and key in range(len(obj))
            obj = obj[key] if inside else None
        return obj

    rng = random.Random(0)
    for _ in range(400):
        data = copy.deepcopy(rng.choice(bases))
        choices = [p for p in paths(data) if p]
        for _ in range(rng.randint(1, 3)):
            *head, last = rng.choice(choices)
            parent = parent_of(data, head)
            if isinstance(parent, dict) and rng.random() < 0.3:
                parent.pop(last, None)
            elif parent_of(parent, [last]) is not None or isinstance(parent, dict):
                parent[last] = rng.choice(values)
        try:
            read_snapshot(data)
        except SnapshotError:
            pass


def test_a_free_takes_the_phase_of_its_moment_not_of_its_allocations_stack():
    # torch logs a deferred free_completed with the stack of the allocation: that stack names forward, but the
    # activation dies in the backward
    g = Gpu(0)
    forward = python_stack(("/src/model.py", "forward"), ("/src/train.py", "main"))
    a = g.alloc(4096, 1, frames=forward)
    g.alloc(1024, 2, frames=backward_stack())
    g.free(a, 3, frames=forward)
    tl = read_snapshot(snapshot_of([g]))
    assert [PHASES[p] for p in tl.column("phase")] == ["forward", "backward", "backward"]
    assert tl.phase_spans() == [("forward", 0.0, 1e-6), ("backward", 1e-6, 2e-6)]


def test_blocks_are_counted_by_power_of_two_size_range_and_state():
    sizes = [(256, "inactive"), (512, "active_allocated"), (1000, "inactive"), (1024, "active_allocated")]
    sizes += [(1536, "active_allocated"), (MiB, "inactive"), (3 * MiB, "active_allocated"), (GiB, "active_allocated")]
    sizes += [(3 * GiB, "active_pending_free")]  # 256 B: no block torch's allocator makes, but it reads
    blocks, addr = [], 0x7F00_0000_0000
    for size, state in sizes:
        blocks.append({"address": addr, "size": size, "requested_size": size, "state": state, "frames": []})
        addr += size
    seg = {"device": 0, "address": 0x7F00_0000_0000, "total_size": addr - 0x7F00_0000_0000, "stream": 0,
           "blocks": blocks}  # fmt: skip
    tl = read_snapshot(pickled([seg]))
    assert tl.meta["segments"]["cuda:0"]["blocks_by_size"] == {
        "<512 B": {"inactive": 1},
        "512-1024 B": {"active_allocated": 1, "inactive": 1},
        "1-2 KiB": {"active_allocated": 2},
        "1-2 MiB": {"inactive": 1},
        "2-4 MiB": {"active_allocated": 1},
        "1-2 GiB": {"active_allocated": 1},
        "2-4 GiB": {"active_pending_free": 1},
    }
    assert tl.meta["segments"]["cuda:0"]["largest_inactive_block"] == MiB
