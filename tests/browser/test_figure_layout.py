"""Every memkit figure, drawn by plotly.js in headless Chromium at 700, 800 and 1400 px wide, has readable text.

The figures are the ones the notebooks and the Playground show, built from small real memkit data (tiny presets:
an estimate judged against a GPU, a tracked comparison, a plan, RSS samples): a timeline, a comparison (the
notebooks' four variants and the Playground's two), the categories at the peak, the allocator's segments, a plan's
frontier and the RSS curves. Each is drawn as a stored notebook picture is (the figure's own height, else kaleido's
500 px, at a fixed width; 700 px is kaleido's default width) and, for the Playground's two, as the app draws it
live (:func:`memkit.widgets.figures._fit`: the container's width, the app's height). From the page's DOM
(``getBoundingClientRect``; tick labels as their rotated boxes) the test reads the boxes of the title, the axis
titles, the legend, each annotation and each tick label, and fails when

- two of title / axis titles / legend / annotations overlap, or one of them covers a tick label
  (more than ``TOLERANCE`` px each way);
- two tick labels of one axis overlap;
- any of those boxes reaches outside the figure's own svg (clipped);
- the legend shows one name twice.

Every figure the notebooks store (as a PNG, from plotly) is drawn too, from the plotly JSON ``make notebooks``
records beside them (``notebooks/figures/<notebook>.json``, written by ``notebooks/_store.py``; a unit test holds
each record to its notebook's PNGs): the figures the notebooks build by hand (02's EMA curves, 03's frontier, 04's
and 05's curves, 07's per-GPU lines) as well as memkit's, at the stored width (700 px) and at 800 and 1400 px.

``MEMKIT_FIGURE_DIR=dir`` also writes each drawing there as a PNG, to look at. Plotly.js comes from the installed
plotly package (no network). Needs Playwright and Chromium (``conftest.py``); run by ``make browser-test``.
"""

from __future__ import annotations

import itertools
import json
import os
import time
import types
from pathlib import Path

import numpy as np
import plotly.io as pio
import pytest
from plotly.offline import get_plotlyjs

from memkit.widgets.app import LIVE_HEIGHT, RESULT_HEIGHT
from memkit.widgets.figures import _fit

WIDTHS = (700, 800, 1400)
TOLERANCE = 2  # px: boxes that touch by this much are taken as not overlapping (anti-aliased edges)
STORED_HEIGHT = 500  # kaleido's default height: a stored notebook picture of a figure with none of its own
LIVE = {"timeline": LIVE_HEIGHT, "comparison": RESULT_HEIGHT}  # the Playground's figure heights

# Each case: (figure, how it is drawn). "stored": a fixed width, the figure's height or kaleido's; "live": the
# Playground's WidgetFigure (the container's width, its height).
CASES = [
    ("timeline, tracked step", "stored"),
    ("timeline, tracked step", "live"),
    ("timeline, estimate judged against a GPU", "stored"),
    ("timeline, estimate judged against a GPU", "live"),
    ("comparison, four estimates", "stored"),
    ("comparison, tracked", "stored"),
    ("comparison, tracked", "live"),
    ("comparison, a variant outside tolerance", "stored"),
    ("categories", "stored"),
    ("segments", "stored"),
    ("plan", "stored"),
    ("rss", "stored"),
]

NOTEBOOK_FIGURES = Path(__file__).resolve().parents[2] / "notebooks" / "figures"
STORED = [
    (f"{record.stem}, cell {figure['cell']}, figure {k}", figure["figure"])
    for record in sorted(NOTEBOOK_FIGURES.glob("*.json"))
    for k, figure in enumerate(json.loads(record.read_text())["figures"])
]  # fmt: skip

# The boxes in a drawn figure (plotly's class names); tick labels as the four corners of each rotated text.
MEASURE_JS = """(gd) => {
  const box = (el) => { const r = el.getBoundingClientRect(); return [r.left, r.top, r.right, r.bottom]; };
  const svg = box(gd.querySelector('.main-svg'));
  const boxes = [];
  const add = (kind, el, name) => {
    const b = box(el);
    const text = name || el.textContent.trim().slice(0, 60);
    if (b[2] - b[0] > 0 && b[3] - b[1] > 0) boxes.push({kind, name: text, box: b});
  };
  gd.querySelectorAll('.infolayer .gtitle').forEach(el => add('title', el));
  gd.querySelectorAll('.infolayer [class$="title"]:not(.gtitle):not(.legendtitletext)').forEach(el => {
    if (/^[xy]\\d*title$/.test(el.getAttribute('class'))) add('axis title', el);
  });
  gd.querySelectorAll('.infolayer .legend .bg').forEach(el => add('legend', el, 'legend'));
  gd.querySelectorAll('.annotation .annotation-text-g').forEach(el => add('annotation', el));
  const ticks = [];
  gd.querySelectorAll('.xaxislayer-above, .yaxislayer-above').forEach((layer, axis) => {
    layer.querySelectorAll('text').forEach(t => {
      if (!t.textContent.trim() || t.style.display === 'none' || t.getAttribute('display') === 'none') return;
      const b = t.getBBox(), m = t.getScreenCTM();
      const corners = [[b.x, b.y], [b.x + b.width, b.y], [b.x + b.width, b.y + b.height], [b.x, b.y + b.height]]
        .map(([x, y]) => [m.a * x + m.c * y + m.e, m.b * x + m.d * y + m.f]);
      ticks.push({axis, name: t.textContent.trim(), corners, box: box(t)});
    });
  });
  const legend = [...gd.querySelectorAll('.legend .traces .legendtext')].map(el => el.textContent.trim());
  return {svg, boxes, ticks, legend};
}"""


@pytest.fixture(scope="module")
def figures():
    """Each case's figure, built once from tiny real data (~20 s on two busy cores)."""
    import memkit
    from memkit import plots
    from memkit.memory import Timeline
    from memkit.memory.rss import sample_rss
    from memkit.planning import plan

    quiet = {"progress": False}
    estimate = memkit.estimate("dit", size="tiny", gpu="4090", **quiet)
    kinds = {"no optimizer": {"optimizer": None}, "AdamW": {"optimizer": "adamw"}}  # notebook 01's four variants
    four = {}
    for (name, kw), ckpt in itertools.product(kinds.items(), (False, True)):
        opts = [memkit.Checkpointing()] if ckpt else []
        four[name + (" + ckpt" if ckpt else "")] = memkit.estimate(
            "dit", size="tiny", optimizations=opts, **kw, **quiet
        )
    variant = {"checkpointing:every:2": [memkit.Checkpointing(pattern="every:2")]}
    tracked = memkit.compare(lambda: memkit.load_model("dit", size="tiny", seed=0), variant, repeats=0, **quiet)
    timeline = tracked.results["baseline"].timeline
    failed = types.SimpleNamespace(
        baseline="baseline",
        results={name: types.SimpleNamespace(timeline=r.timeline, passed=name == "baseline")
                 for name, r in tracked.results.items()},
    )  # fmt: skip
    # in KiB: labels as long as notebook 01's ("110.85 GiB" over each of four bars)
    four_fig = memkit.Comparison.from_timelines(four, baseline="no optimizer").figure(unit="KiB")
    four_fig.update_layout(title="dit (tiny, bfloat16, CUDA): estimated memory", height=500)  # as notebook 01 does
    rss = {}  # a long run holding 40 MB and a short one touching 8 MB at a time, as notebook 05's off and disk
    for name, n, held, each in (("off", 40, 5 << 20, 0), ("disk, prefetch 1", 4, 0, 1 << 20)):
        with sample_rss(0.001) as rss[name]:
            kept = np.ones(held)
            for _ in range(n):
                np.ones(each).sum()
                time.sleep(0.002)
            del kept
    return {
        "timeline, tracked step": plots.timeline_figure(timeline, title=f"live: baseline ({len(timeline):,} events)"),
        "timeline, estimate judged against a GPU": plots.timeline_figure(
            estimate, title="Estimate, baseline: dit (tiny), allocated and reserved", unit="GiB"
        ),
        "comparison, four estimates": four_fig,
        "comparison, tracked": plots.comparison_figure(tracked),
        "comparison, a variant outside tolerance": plots.comparison_figure(failed),
        "categories": plots.categories_figure(timeline),
        "segments": plots.segments_figure(Timeline({}, devices=["cuda:0", "cuda:1"], meta={"segments": SEGMENTS})),
        "plan": plots.plan_figure(plan("dit", "4090", lora=4, size="tiny")),
        "rss": plots.rss_figure(rss),
    }


MiB = 1 << 20
SEGMENTS = {
    device: {
        "segments": 3,
        "reserved_bytes": 60 * MiB,
        "blocks": {
            "active_allocated": {"count": 5, "bytes": 40 * MiB},
            "active_pending_free": {"count": 1, "bytes": 2 * MiB},
            "inactive": {"count": 4, "bytes": 18 * MiB},
        },
        "blocks_by_size": {
            "< 1 MiB": {"active_allocated": 2, "inactive": 3},
            "1-2 MiB": {"active_allocated": 2, "active_pending_free": 1},
            "2-20 MiB": {"active_allocated": 1, "inactive": 1},
        },
    }
    for device in ("cuda:0", "cuda:1")
}


@pytest.fixture(scope="module")
def page(chromium):
    page = chromium.new_page(viewport={"width": 1500, "height": 900})
    page.set_content("<html><body style='margin:0'></body></html>")
    page.add_script_tag(content=get_plotlyjs())  # the installed plotly's own bundle, offline
    yield page
    page.close()


def _draw(page, fig, width: int, how: str, kind: str):
    """The figure drawn in a fresh div ``width`` px wide, as a stored picture or as the Playground draws it."""
    spec = json.loads(json.dumps(fig) if isinstance(fig, dict) else pio.to_json(fig, validate=False))
    layout = spec.setdefault("layout", {})
    if how == "stored":
        layout.update(width=width, height=layout.get("height") or STORED_HEIGHT, autosize=False)
    else:
        spec = json.loads(pio.to_json(_fit(fig, LIVE[kind]), validate=False))
    page.evaluate(
        """async ([spec, width]) => {
          document.body.innerHTML = '';
          const gd = document.createElement('div');
          gd.style.width = width + 'px';
          document.body.appendChild(gd);
          await Plotly.newPlot(gd, spec.data, spec.layout, {responsive: false});
        }""",
        [spec, width],
    )
    return page.locator(".js-plotly-plot").element_handle()


def _save(gd, name: str) -> None:
    """With ``MEMKIT_FIGURE_DIR`` set, the drawing as a PNG there, to look at."""
    if os.environ.get("MEMKIT_FIGURE_DIR"):
        out = Path(os.environ["MEMKIT_FIGURE_DIR"])
        out.mkdir(parents=True, exist_ok=True)
        gd.screenshot(path=str(out / f"{name.replace(' ', '_').replace(',', '')}.png"))


def _overlap(a, b) -> bool:
    return min(a[2], b[2]) - max(a[0], b[0]) > TOLERANCE and min(a[3], b[3]) - max(a[1], b[1]) > TOLERANCE


def _quads_overlap(p, q) -> bool:
    """Two convex quadrilaterals (rotated text boxes) overlap by more than TOLERANCE along every separating axis."""
    for poly in (p, q):
        for i in range(4):
            (x0, y0), (x1, y1) = poly[i], poly[(i + 1) % 4]
            n = np.array([y0 - y1, x1 - x0], dtype=float)
            if not np.any(n):
                continue
            n /= np.linalg.norm(n)
            a, b = np.asarray(p) @ n, np.asarray(q) @ n
            if min(a.max(), b.max()) - max(a.min(), b.min()) <= TOLERANCE:
                return False
    return True


def problems(measured: dict) -> list[str]:
    """What is wrong with a drawn figure's boxes (see the module's docs); empty when it is readable."""
    found = []
    svg, boxes, ticks = measured["svg"], measured["boxes"], measured["ticks"]
    for a, b in itertools.combinations(boxes, 2):
        if _overlap(a["box"], b["box"]):
            found.append(f"{a['kind']} {a['name']!r} overlaps {b['kind']} {b['name']!r}")
    for a, t in itertools.product(boxes, ticks):
        if _overlap(a["box"], t["box"]) and _quads_overlap(_corners(a["box"]), t["corners"]):
            found.append(f"{a['kind']} {a['name']!r} covers tick label {t['name']!r}")
    by_axis = itertools.groupby(sorted(ticks, key=lambda t: t["axis"]), key=lambda t: t["axis"])
    for _, same in by_axis:
        for a, b in itertools.combinations(list(same), 2):
            if _quads_overlap(a["corners"], b["corners"]):
                found.append(f"tick labels {a['name']!r} and {b['name']!r} overlap")
    for item in [*boxes, *ticks]:
        x0, y0, x1, y1 = item["box"]
        if x0 < svg[0] - 1 or y0 < svg[1] - 1 or x1 > svg[2] + 1 or y1 > svg[3] + 1:
            what = item.get("kind", "tick label")
            found.append(f"{what} {item['name']!r} is clipped: {[round(v) for v in item['box']]} outside {svg}")
    names = [n for n in measured["legend"] if n]
    found += [f"the legend lists {n!r} {names.count(n)} times" for n in sorted(set(names)) if names.count(n) > 1]
    return found


def _corners(b):
    return [(b[0], b[1]), (b[2], b[1]), (b[2], b[3]), (b[0], b[3])]


@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize(("name", "how"), CASES)
def test_every_figure_is_readable(page, figures, name, how, width):  # page first: no data built to be skipped
    kind = name.split(",")[0]
    gd = _draw(page, figures[name], width, how, kind)
    measured = page.evaluate(MEASURE_JS, gd)
    _save(gd, f"{name}-{how}-{width}")
    assert len(measured["ticks"]) > 2 and measured["boxes"], measured  # the figure was drawn
    found = problems(measured)
    assert not found, "\n".join(found)


def test_notebooks_store_their_figures():
    assert len(STORED) >= 20, f"{len(STORED)} figures recorded in {NOTEBOOK_FIGURES}: run `make notebooks`"


@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize(("name", "figure"), STORED, ids=[name for name, _ in STORED])
def test_every_stored_notebook_figure_is_readable(page, name, figure, width):
    gd = _draw(page, figure, width, "stored", "")
    measured = page.evaluate(MEASURE_JS, gd)
    _save(gd, f"{name}-{width}")
    assert measured["boxes"] or measured["ticks"], measured  # the figure was drawn
    found = problems(measured)
    assert not found, "\n".join(found)


def test_the_check_sees_a_legend_over_the_axis_title_and_overlapping_labels(page):
    """The test can fail: a legend laid over the x-axis title, two annotations at one place, a clipped title."""
    import plotly.graph_objects as go

    fig = go.Figure(go.Scatter(x=[0, 1], y=[0, 1], name="a"))
    fig.add_trace(go.Scatter(x=[0, 1], y=[1, 0], name="a"))
    fig.add_annotation(x=0.5, y=0.5, text="one label", showarrow=False)
    fig.add_annotation(x=0.5, y=0.5, text="another label", showarrow=False)
    fig.update_layout(
        title={"text": "a title far too long to fit " * 6, "x": 0.5},
        xaxis_title="time (s)",
        legend={"orientation": "h", "yanchor": "top", "y": -0.12, "x": 0.4},  # as memkit's was, under the plot
    )
    gd = _draw(page, fig, 800, "stored", "")
    found = "\n".join(problems(page.evaluate(MEASURE_JS, gd)))
    assert "legend 'legend' overlaps axis title 'time (s)'" in found or "axis title 'time (s)' overlaps legend" in found
    assert "'one label' overlaps annotation 'another label'" in found
    assert "title 'a title far too long" in found and "is clipped" in found
    assert "the legend lists 'a' 2 times" in found
