import json
import os
import types

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import memkit
from memkit import plots
from memkit.comparison import VariantResult
from memkit.memory import CATEGORIES, PHASES, Timeline

MiB = 1 << 20


def synthetic(n: int, *, seed: int = 0, phases: np.ndarray | None = None) -> Timeline:
    """n events: n/2 allocations of random size and category, each freed a random while later."""
    rng = np.random.default_rng(seed)
    m = n // 2
    size = rng.integers(1, 1 << 20, m)
    cat = rng.integers(0, len(CATEGORIES), m)
    t_alloc = np.sort(rng.random(m)) * 10
    t = np.concatenate([t_alloc, t_alloc + rng.exponential(0.05, m)])
    order = np.argsort(t, kind="stable")
    columns = {
        "time": t[order],
        "action": np.repeat([0, 1], m)[order],
        "bytes": np.tile(size, 2)[order],
        "category": np.tile(cat, 2)[order],
        "phase": (t[order] // 2.5 % len(PHASES)) if phases is None else phases,
        "device": np.zeros(2 * m),
        "storage": np.tile(np.arange(m), 2)[order],
    }
    return Timeline(columns=columns, baseline_by_category={"parameter": 1 << 30, "input": 12345}, devices=["cpu"])


def stacked(fig) -> dict:
    """The filled category traces of a timeline figure, by name."""
    return {tr.name: np.asarray(tr.y) for tr in fig.data if tr.stackgroup}


@pytest.fixture(scope="module")
def tracked():
    """Two real training steps of a tiny MLP (wide and narrow) under memkit.track()."""

    def step(width: int) -> Timeline:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(16, width), torch.nn.GELU(), torch.nn.Linear(width, 16))
        opt = torch.optim.AdamW(model.parameters())
        x = torch.randn(8, 16)
        with memkit.track(model, optimizer=opt, inputs=x) as tl:
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
        return tl

    return step(256), step(64)


def test_decimate_keeps_peak_endpoints_and_budget():
    tl = synthetic(100_000, seed=1)
    live = tl.live_bytes
    for max_points in (3, 4, 5, 100, 4000):
        idx = plots.decimate(tl, max_points)
        assert len(idx) <= max_points
        assert np.all(np.diff(idx) > 0)
        assert {0, len(tl) - 1, tl.peak_index} <= set(idx.tolist())
        assert live[idx].max() == tl.peak_bytes
    assert len(plots.decimate(tl, 4000)) > 3000  # uses the budget, not just the extremes
    np.testing.assert_array_equal(plots.decimate(synthetic(50), 4000), np.arange(50))
    with pytest.raises(ValueError, match="max_points"):
        plots.decimate(tl, 2)


def test_million_events_keep_exact_peak_in_a_small_figure():
    tl = synthetic(1_000_000)
    fig = plots.timeline_figure(tl)
    top = sum(stacked(fig).values())
    assert top.max() == tl.peak_bytes / MiB  # powers of two divide exactly
    assert len(top) <= 4001
    assert len(fig.to_json()) < 1_000_000


@settings(max_examples=30, deadline=None)
@given(
    ops=st.lists(
        st.tuples(st.booleans(), st.integers(0, 1 << 40), st.sampled_from(range(len(CATEGORIES))), st.integers(0, 99)),
        max_size=80,
    ),
    baseline=st.dictionaries(st.sampled_from(CATEGORIES), st.integers(0, 1 << 30)),
    max_points=st.integers(3, 30),
)
def test_decimated_stack_is_exact(ops, baseline, max_points):
    rows, live = [], []  # (action, bytes, category, storage); free a live storage chosen by the draw
    for i, (alloc, size, cat, pick) in enumerate(ops):
        if alloc or not live:
            live.append((size, cat, i))
            rows.append((0, size, cat, i))
        else:
            size, cat, key = live.pop(pick % len(live))
            rows.append((1, size, cat, key))
    action, nbytes, cat, storage = (np.array(c, dtype=np.int64) for c in zip(*rows, strict=True)) if rows else [[]] * 4
    n = len(rows)
    columns = {"time": np.arange(n) * 0.1, "action": action, "bytes": nbytes, "category": cat}
    columns |= {"phase": np.arange(n) // 7 % len(PHASES), "device": np.zeros(n), "storage": storage}
    tl = Timeline(columns=columns, baseline_by_category=baseline, devices=["cpu"])

    idx = plots.decimate(tl, max_points)
    fig = plots.timeline_figure(tl, max_points=max_points, unit="B")
    traces, by_cat = stacked(fig), tl.live_by_category()
    assert sum(traces.values(), np.zeros(len(idx) + 1)).max() == tl.peak_bytes
    for name in CATEGORIES:
        if name in traces:  # first point: the baseline at t=0; then one per kept event
            assert traces[name][0] == baseline.get(name, 0)
            np.testing.assert_array_equal(traces[name][1:], by_cat[name][idx])
        else:
            assert not by_cat[name].any() and not baseline.get(name, 0)


def test_timeline_figure_on_a_tracked_step(tracked):
    tl = tracked[0]
    fig = plots.timeline_figure(tl, title="tiny step")
    nonzero = [c for c in CATEGORIES if tl.live_by_category()[c].any() or tl.baseline_by_category[c]]
    assert list(stacked(fig)) == nonzero and {"parameter", "gradient", "optimizer_state"} <= set(nonzero)
    for tr in fig.data:
        if tr.stackgroup:
            assert tr.line.shape == "hv" and tr.fillcolor == plots.CATEGORY_COLORS[tr.name]
    assert sum(stacked(fig).values()).max() == tl.peak_bytes / MiB
    (note,) = fig.layout.annotations
    assert f"{tl.peak_bytes:,} B" in note.text and f"{tl.peak_bytes / MiB:,.2f} MiB" in note.text
    assert (note.x, note.y) == (tl.peak_time, tl.peak_bytes / MiB)
    phases = {name for name, _, _ in tl.phase_spans()}
    assert len(phases) > 1
    assert {s.name for s in fig.layout.shapes} == phases
    assert len(plots.timeline_figure(tl, show_phases=False).layout.shapes) == 0
    assert fig.layout.title.text == "tiny step"
    gib = plots.timeline_figure(tl, unit="GiB")
    assert sum(stacked(gib).values()).max() == tl.peak_bytes / (1 << 30)
    with pytest.raises(ValueError, match="unit must be one of"):
        plots.timeline_figure(tl, unit="MB")


def test_many_phase_runs_are_binned():
    n = 20_000
    tl = synthetic(n, phases=np.random.default_rng(0).integers(0, len(PHASES), n))
    fig = plots.timeline_figure(tl)
    assert 1 < len(fig.layout.shapes) <= plots._MAX_PHASE_SPANS
    assert len(json.loads(fig.to_json())["layout"]["shapes"]) == len(fig.layout.shapes)


def test_the_legend_names_each_entry_once_when_a_phase_and_a_category_share_a_name():
    tl = synthetic(2000)  # every phase and every category: "ema" is both (the EMA's update and its shadow weights)
    fig = plots.timeline_figure(tl)
    shown = [tr.name for tr in fig.data if tr.showlegend is not False and tr.name]
    shown += [shape.name for shape in fig.layout.shapes if shape.showlegend]
    assert {"ema", "ema (phase)", "forward"} <= set(shown)
    assert len(shown) == len(set(shown)), shown


def test_empty_timeline_draws_its_baseline():
    columns = {name: np.zeros(0) for name in ("time", "action", "bytes", "category", "phase", "device", "storage")}
    tl = Timeline(columns=columns, baseline_by_category={"parameter": 3 * MiB}, devices=["cpu"])
    fig = plots.timeline_figure(tl)
    assert {k: v.tolist() for k, v in stacked(fig).items()} == {"parameter": [3.0]}
    assert "3.00 MiB" in fig.layout.annotations[0].text


def test_comparison_figure_bars_are_the_peaks(tracked):
    wide, narrow = tracked
    results = {
        "baseline": VariantResult("baseline", timeline=wide),
        "narrow": VariantResult("narrow", timeline=narrow, passed=False),
    }
    comparison = types.SimpleNamespace(results=results, baseline="baseline", mode="training", tolerance=1e-5)
    fig = plots.comparison_figure(comparison)
    bars = [tr for tr in fig.data if tr.type == "bar"]
    assert {tr.marker.color for tr in bars} <= set(plots.CATEGORY_COLORS.values())
    assert all(tr.marker.color == plots.CATEGORY_COLORS[tr.name] for tr in bars)
    totals = sum(np.asarray(tr.y) for tr in bars)
    assert totals.tolist() == [wide.peak_bytes / MiB, narrow.peak_bytes / MiB]
    notes = {a.x: a.text for a in fig.layout.annotations if a.x in results}
    change = narrow.peak_bytes / wide.peak_bytes - 1
    assert f"{change:+.1%}" in notes["narrow"] and "✗" in notes["narrow"]
    assert "baseline" in notes["baseline"] and "✗" not in notes["baseline"]
    assert "✗: outputs or gradients outside tolerance" in fig.layout.title.text  # what the mark means
    lines = {tr.name: tr for tr in fig.data if tr.type == "scatter"}
    assert list(lines) == ["baseline", "narrow"]
    for name, tl in zip(lines, tracked, strict=True):
        x = np.asarray(lines[name].x)
        assert x[0] == 0 and x[-1] == 1 and np.all(np.diff(x) >= 0)
        assert np.asarray(lines[name].y).max() == tl.peak_bytes / MiB
    results["narrow"] = VariantResult("narrow")
    with pytest.raises(ValueError, match="'narrow' has no timeline"):
        plots.comparison_figure(comparison)


def test_categories_figure_sums_to_peak(tracked):
    tl = tracked[0]
    (bar,) = plots.categories_figure(tl, unit="KiB").data
    assert sum(bar.x) == tl.peak_bytes / 1024
    assert list(bar.y) == [c for c, v in tl.peak_by_category().items() if v]


@pytest.mark.skipif(not os.path.exists("/usr/bin/chromium"), reason="PNG export needs Chromium at /usr/bin/chromium")
@pytest.mark.slow  # kaleido starts Chromium: seconds
def test_png_export(tracked, monkeypatch):
    monkeypatch.setenv("BROWSER_PATH", "/usr/bin/chromium")
    png = plots.timeline_figure(tracked[0]).to_image(format="png", width=600, height=300)
    assert png.startswith(b"\x89PNG") and len(png) > 5000


def test_every_category_has_a_colour_and_unknown_is_last():
    assert list(plots.CATEGORY_COLORS) == list(CATEGORIES) and CATEGORIES[-1] == "unknown"
    assert len(set(plots.CATEGORY_COLORS.values())) == len(CATEGORIES)


def two_devices(time_unit="s") -> Timeline:
    columns = {
        "time": [0.0, 1.0, 2.0, 3.0],
        "action": [0, 0, 1, 1],
        "bytes": [4 * MiB, 2 * MiB, 4 * MiB, 2 * MiB],
        "category": [CATEGORIES.index("activation")] * 4,
        "phase": [0, 0, 1, 1],
        "device": [0, 1, 0, 1],
        "storage": [1, 2, 1, 2],
    }
    split = {"cuda:0": {"parameter": 8 * MiB}, "cuda:1": {"unknown": 1 * MiB}}
    meta = {"time_unit": time_unit}
    return Timeline(columns, devices=["cuda:0", "cuda:1"], baseline_by_device=split, meta=meta)


def test_several_devices_get_one_panel_each_and_the_title_says_the_sum():
    tl = two_devices()
    assert tl.peak_by_device() == {"cuda:0": 12 * MiB, "cuda:1": 3 * MiB} and tl.peak_bytes == 15 * MiB
    fig = plots.timeline_figure(tl)
    totals = {tr.name: (tr.xaxis, max(tr.y)) for tr in fig.data if tr.name.startswith("total")}
    assert totals == {"total cuda:0": ("x", 12.0), "total cuda:1": ("x2", 3.0)}
    groups = {tr.stackgroup for tr in fig.data if tr.stackgroup}
    assert groups == {"memory1", "memory2"}  # never stacked across devices
    assert sum(tr.showlegend is not False for tr in fig.data if tr.stackgroup) == 3  # one legend entry per category
    assert "2 devices" in fig.layout.title.text and "15.00 MiB" in fig.layout.title.text
    assert fig.layout.xaxis2.title.text == "time (s)"


def test_an_event_index_axis_is_not_labelled_seconds():
    fig = plots.timeline_figure(two_devices("event"))
    assert fig.layout.xaxis2.title.text == "event (the trace has no times)"
    peaks = [a.text for a in fig.layout.annotations if a.text.startswith("peak")]
    assert peaks and all("at event " in t and not t.endswith(" s") for t in peaks)


def test_a_multi_device_timeline_with_an_unknown_baseline_split_is_drawn_as_one_total():
    columns = {k: v for k, v in two_devices().to_pandas().items() if k in ("time", "bytes")}
    tl = Timeline(
        {**columns, "action": [0, 0, 1, 1], "category": [5] * 4, "phase": [0] * 4, "device": [0, 1, 0, 1]}
        | {"storage": [1, 2, 1, 2]},
        devices=["cpu", "cuda:0"],
        baseline_by_category={"parameter": MiB},
    )
    assert tl.baseline_by_device is None
    with pytest.raises(ValueError, match="split between them is unknown"):
        tl.peak_by_device()
    fig = plots.timeline_figure(tl)
    assert [tr.name for tr in fig.data if tr.name and tr.name.startswith("total")] == ["total"]
    with pytest.raises(ValueError, match="segments"):
        plots.segments_figure(tl)


def test_an_estimate_s_first_and_steady_step_are_marked():
    tl = memkit.estimate("dit", size="tiny")
    start = tl.meta["step_starts"][1]
    fig = plots.timeline_figure(tl)
    texts = {a.text: a.x for a in fig.layout.annotations}
    assert "first step →" in texts and "steady step →" in texts
    steady_lines = [s for s in fig.layout.shapes if s.type == "line" and s.line.dash == "dash"]
    assert [s.x0 for s in steady_lines] == pytest.approx([float(tl.time[start])])
    one = memkit.estimate("dit", size="tiny", steps=2)  # one step measured: nothing to mark
    assert not any("steady step" in (a.text or "") for a in plots.timeline_figure(one).layout.annotations)


def test_a_judged_estimate_draws_the_gpu_s_usable_bytes_and_an_unjudged_one_does_not():
    tl = memkit.estimate("dit", size="tiny", gpu="1GiB")  # a size: its usable bytes are its total less the rest
    low = memkit.gpus.find("1GiB").usable_bytes()[0]
    fig = plots.timeline_figure(tl, unit="MiB")
    line = [t for t in fig.data if t.name == "a 1GiB GPU: usable"]
    assert len(line) == 1 and list(line[0].y) == [low / 2**20] * 2
    assert line[0].x[0] == 0 and line[0].x[-1] == pytest.approx(float(tl.time[-1]))  # across the whole window
    assert any(a.text.startswith("a 1GiB GPU: usable") for a in fig.layout.annotations)
    assert "reserved" in {t.name for t in fig.data}
    plain = plots.timeline_figure(memkit.estimate("dit", size="tiny"))
    assert not any("usable" in (t.name or "") for t in plain.data)


def a_plan(points, usable=10 * 2**30):
    """A memkit.Plan over candidates ``(step seconds or None, peak reserved bytes)`` on a card with ``usable`` bytes,
    the timed fitting ones first, fastest first (as plan() ranks what it times)."""
    from memkit.planning import Candidate, Plan

    total = usable + (1 << 40) - memkit.gpus.GPU("p", "p", (1 << 40, 1 << 40), "", 90).usable_bytes()[0]
    gpu = memkit.gpus.GPU("test", "a test card", (total, total), "a test card", 90)
    tried = [
        Candidate({}, "", (), ("--optimizer", f"opt{i}") if i else (), m, m, m <= usable, usable - m, t)
        for i, (t, m) in enumerate(points)
    ]
    fitting = [c for c in tried if c.fits]
    timed = sorted((c for c in fitting if c.step_seconds is not None), key=lambda c: c.step_seconds)
    return Plan(gpu, timed + [c for c in fitting if c.step_seconds is None], tried, len(tried), 0.0)


def test_plan_figure_draws_each_timed_configuration_the_frontier_the_gpu_and_the_choice():
    GiB = 2**30
    # (seconds, bytes): the fastest is too large; 1 and 3 fit, 3 is beaten by 1 (slower and larger); 4 is not timed
    p = a_plan([(1.0, 12 * GiB), (2.0, 8 * GiB), (4.0, 4 * GiB), (3.0, 9 * GiB), (None, 2 * GiB)])
    fig = plots.plan_figure(p)
    traces = {tr.name: tr for tr in fig.data}
    fits, fails = traces["fits"], traces["does not fit"]
    assert (list(fits.x), list(fits.y)) == ([2.0, 4.0, 3.0], [8, 4, 9]) and fits.marker.symbol == "circle"
    assert (list(fails.x), list(fails.y)) == ([1.0], [12]) and fails.marker.symbol == "x"
    assert list(fits.customdata) == ["--optimizer opt1", "--optimizer opt2", "--optimizer opt3"]
    assert list(fails.customdata) == ["(nothing switched on)"]  # the hover names the flags
    frontier = traces["frontier (no other both faster and smaller)"]
    assert (list(frontier.x), list(frontier.y)) == ([1.0, 2.0, 4.0], [12, 8, 4]) and frontier.line.shape == "hv"
    chosen = traces["chosen: --optimizer opt1"]
    assert (list(chosen.x), list(chosen.y)) == ([2.0], [8])
    (line,) = fig.layout.shapes
    assert line.y0 == line.y1 == 10 and line.line.dash == "dash"
    high = p.gpu.usable_bytes()[1] / GiB  # the context's spread above the low end the line is drawn at
    assert [a.text for a in fig.layout.annotations] == [f"a test card: usable 10.00 GiB (spread to {high:.2f} GiB)"]
    assert "1 estimated without a step time (not drawn)" in fig.layout.title.text
    assert "steady step" in fig.layout.xaxis.title.text and "a test card" in fig.layout.xaxis.title.text
    assert all(w in fig.layout.yaxis.title.text for w in ("GiB", "first/steady step", "reserved bytes", "cuda"))
    assert fig.layout.yaxis.range[0] == 0 and fig.layout.yaxis.range[1] > 12


def test_plan_figure_needs_step_times_and_says_how_to_get_them():
    with pytest.raises(ValueError, match=r"plan with step_time=True \(the default; memkit plan without --no-time\)"):
        plots.plan_figure(a_plan([(None, 2**30), (None, 2**31)]))


def test_rss_figure_gives_each_run_a_panel_on_one_memory_scale():
    from memkit.memory import RSSSamples

    runs = {"off": RSSSamples([0.0, 1.0, 3.5], [500 * MiB, 560 * MiB, 557 * MiB]),
            "disk": RSSSamples([0.0, 0.1, 0.3], [420 * MiB, 440 * MiB, 430 * MiB])}  # fmt: skip
    fig = plots.rss_figure(runs)
    assert [list(tr.y) for tr in fig.data] == [[500, 560, 557], [420, 440, 430]]
    assert [tr.xaxis for tr in fig.data] == ["x", "x2"]  # a time axis each: the short run is not squeezed
    assert fig.layout.yaxis2.matches == "y"  # one memory scale
    assert [a.text for a in fig.layout.annotations] == ["off: peak 560.00 MiB", "disk: peak 440.00 MiB"]
    assert fig.layout.height > 400
    with pytest.raises(ValueError, match="samples is empty"):
        plots.rss_figure({})


def test_a_peak_too_small_for_the_figure_s_unit_is_noted_in_its_own():
    columns = {"time": [0.0, 1.0], "action": [0, 1], "bytes": [3 * MiB] * 2, "category": [7] * 2, "phase": [0] * 2}
    tl = Timeline(columns=columns | {"device": [0, 0], "storage": [1, 1]}, devices=["cpu"])
    note = plots.timeline_figure(tl, unit="GiB").layout.annotations[0].text  # 0.00 GiB, judged against a card
    assert note.startswith(f"peak 3.00 MiB ({3 * MiB:,} B)")
    assert plots.timeline_figure(tl, unit="KiB").layout.annotations[0].text.startswith("peak 3,072.00 KiB")
