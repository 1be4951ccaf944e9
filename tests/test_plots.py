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
    assert f"{change:+.1%}" in notes["narrow"] and "outside tolerance" in notes["narrow"]
    assert "baseline" in notes["baseline"] and "tolerance" not in notes["baseline"]
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
def test_png_export(tracked, monkeypatch):
    monkeypatch.setenv("BROWSER_PATH", "/usr/bin/chromium")
    png = plots.timeline_figure(tracked[0]).to_image(format="png", width=600, height=300)
    assert png.startswith(b"\x89PNG") and len(png) > 5000
