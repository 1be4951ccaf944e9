"""Plots: pure functions from a :class:`Timeline` or a comparison to a plotly figure.

No torch, no widgets: every function takes plain data and returns a ``go.Figure`` that a notebook shows with
``fig.show()`` (set ``PLOTLY_RENDERER=png`` for notebooks stored with their outputs), a widget wraps in a
``FigureWidget``, and a report writes with ``fig.write_html``. One colour per memory category
(:data:`CATEGORY_COLORS`) is shared by every memkit figure. A plan's frontier (step time against peak reserved
memory): :func:`plan_figure`. The process's resident memory sampled beside a step: :func:`rss_figure`.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from ._plan_figure import plan_figure
from ._rss_figure import rss_figure
from .memory.events import CATEGORIES, PHASES
from .memory.timeline import Timeline
from .units import Unit, best_unit, unit_scale

__all__ = [
    "CATEGORY_COLORS",
    "PHASE_COLORS",
    "categories_figure",
    "comparison_figure",
    "decimate",
    "plan_figure",
    "rss_figure",
    "segments_figure",
    "timeline_figure",
]


CATEGORY_COLORS: dict[str, str] = {
    "parameter": "#4C78A8",
    "unsharded_parameter": "#9ECAE9",
    "buffer": "#72B7B2",
    "gradient": "#F58518",
    "optimizer_state": "#E45756",
    "ema": "#B279A2",
    "collective": "#FF9DA6",
    "activation": "#54A24B",
    "temporary": "#EECA3B",
    "input": "#9D755D",
    "unknown": "#A0A0A0",
}
"""One fixed colour per memory category, used by every memkit figure."""

PHASE_COLORS: dict[str, str] = {
    "forward": "rgba(76, 120, 168, 0.12)",
    "backward": "rgba(245, 133, 24, 0.12)",
    "optimizer": "rgba(228, 87, 86, 0.12)",
    "ema": "rgba(178, 121, 162, 0.14)",
    "other": "rgba(128, 128, 128, 0.08)",
}
"""Light background colour of each phase in :func:`timeline_figure`."""

_VARIANT_COLORS = ("#1b9e77", "#d95f02", "#7570b3", "#e7298a", "#66a61e", "#e6ab02", "#a6761d")
# The legend below the plot, across: beside it, it took width from the plot and scrolled inside it when tall
_LEGEND: dict[str, Any] = {
    "groupclick": "toggleitem",
    "orientation": "h",
    "yref": "container",
    "yanchor": "bottom",
    "y": 0,
    "x": 0,
}
_LAYOUT: dict[str, Any] = {"template": "plotly_white", "legend": _LEGEND, "margin": {"r": 20, "t": 80}}
_MAX_OOMS = 20  # out-of-memory lines drawn at most
_MAX_PHASE_SPANS = 200  # beyond this, shading is binned: more rectangles than pixels only bloat the figure
_STATE_COLORS = {  # the caching allocator's block states (segments_figure)
    "active_allocated": "#4C78A8",
    "active_pending_free": "#F58518",
    "active_awaiting_free": "#E45756",
    "inactive": "#D0D0D0",
}


def _fmt(value: float, unit: str) -> str:
    return f"{value:,.0f} {unit}" if unit == "B" else f"{value:,.2f} {unit}"


def _short(value: float, unit: str) -> str:
    """Three significant digits (1.25 MiB, 61.6 GiB, 1,282 KiB): a label over a bar a fifth of a figure wide."""
    return f"{value:,.0f} {unit}" if abs(value) >= 100 else f"{value:.3g} {unit}"


def _step(x: np.ndarray, y: np.ndarray, name: str, unit: str, **kwargs: Any) -> go.Scatter:
    hover = f"%{{y:,.3f}} {unit}<extra>{name}</extra>"
    return go.Scatter(x=x, y=y, name=name, mode="lines", line_shape="hv", hovertemplate=hover, **kwargs)


def decimate(timeline: Timeline, max_points: int = 4000) -> np.ndarray:
    """Indices of at most ``max_points`` events that keep the shape and the exact peak of ``live_bytes``.

    The events are cut into ``(max_points - 3) // 2`` buckets of consecutive events; from each bucket the
    event with the highest and the one with the lowest total live bytes are kept, plus the first and last
    events and the global peak. Every extreme of the total the eye would notice survives and the top of the
    plotted stack at the peak is ``timeline.peak_bytes`` to the byte; what is lost are the other events of
    each bucket, so a category's brief rise that sets neither extreme of the total is not drawn.
    Vectorized: ~10 ms per 10^6 events.

    Example:
        >>> idx = memkit.plots.decimate(tl, 2000)
        >>> tl.live_bytes[idx].max() == tl.live_bytes.max()
        True
    """
    if not isinstance(max_points, int) or isinstance(max_points, bool) or max_points < 3:
        raise ValueError(f"max_points must be an int >= 3, got {max_points!r}")
    live = timeline.live_bytes
    n = len(live)
    if n <= max_points:
        return np.arange(n, dtype=np.int64)
    keep = [np.array([0, n - 1, int(np.argmax(live))], dtype=np.int64)]
    buckets = (max_points - 3) // 2
    if buckets:
        size = -(-n // buckets)
        # Padding with the last value never wins a bucket: argmax/argmin return the first occurrence.
        rows = np.pad(live, (0, size * buckets - n), mode="edge").reshape(buckets, size)
        start = np.arange(buckets, dtype=np.int64) * size
        keep += [np.minimum(start + rows.argmax(axis=1), n - 1), np.minimum(start + rows.argmin(axis=1), n - 1)]
    return np.unique(np.concatenate(keep))


def _series(timeline: Timeline, max_points: int) -> tuple[np.ndarray, np.ndarray, dict[str, np.ndarray]]:
    """x (seconds), kept event indices, and bytes by category: a baseline point at t=0, then each kept event.

    Equal to ``timeline.live_by_category()`` at the kept indices, but sums the events between kept indices in
    one ``bincount`` instead of eight full cumulative sums (5x faster on 10^6 events, and no 64 MB of series).
    """
    idx = decimate(timeline, max_points)
    time, cat = timeline.time, timeline.column("category").astype(np.int64)
    t0 = min(0.0, float(time[0])) if len(time) else 0.0
    x = np.concatenate([[t0], time[idx]])
    starts = np.zeros(len(time), dtype=np.int64)
    starts[idx[:-1] + 1] = 1  # idx is sorted and unique
    segment = np.cumsum(starts)  # event j first counts at kept point segment[j]
    k = len(CATEGORIES)
    # float64 sums of integer bytes are exact below 2**53 (8 PiB).
    sums = np.bincount(segment * k + cat, weights=timeline.signed_bytes, minlength=len(idx) * k)
    steps = np.cumsum(sums[: len(idx) * k].reshape(len(idx), k), axis=0).astype(np.int64)
    base = timeline.baseline_by_category
    by_cat = {c: base[c] + np.concatenate([[0], steps[:, i]]) for i, c in enumerate(CATEGORIES)}
    return x, idx, by_cat


def _nonzero_categories(timeline: Timeline) -> list[str]:
    """Categories whose live bytes are ever non-zero: a baseline, or any event of non-zero size."""
    sized = np.bincount(timeline.column("category"), weights=timeline.column("bytes") > 0, minlength=len(CATEGORIES))
    base = timeline.baseline_by_category
    return [c for i, c in enumerate(CATEGORIES) if base[c] or sized[i]]


def _phase_spans(timeline: Timeline) -> list[tuple[str, float, float]]:
    """Runs of one phase as (phase, start, end); binned to at most ``_MAX_PHASE_SPANS`` when there are more."""
    phase, time = timeline.column("phase").astype(np.int64), timeline.time
    if len(phase) == 0:
        return []
    if np.count_nonzero(np.diff(phase)) < _MAX_PHASE_SPANS:
        return timeline.phase_spans()
    # Too many runs to draw: take the most frequent phase in each of _MAX_PHASE_SPANS equal time bins.
    t0, t1, k, p = float(time[0]), float(time[-1]), _MAX_PHASE_SPANS, len(PHASES)
    bins = np.clip(((time - t0) / max(t1 - t0, 1e-12) * k).astype(np.int64), 0, k - 1)
    counts = np.bincount(bins * p + phase, minlength=k * p).reshape(k, p)
    filled = np.maximum.accumulate(np.where(counts.any(axis=1), np.arange(k), 0))  # empty bins keep the last phase
    dom = counts.argmax(axis=1)[filled]
    edges = t0 + (t1 - t0) * np.arange(k + 1) / k
    cuts = np.concatenate([[0], np.flatnonzero(np.diff(dom)) + 1, [k]])
    return [(PHASES[dom[a]], float(edges[a]), float(edges[b])) for a, b in zip(cuts[:-1], cuts[1:], strict=True)]


def timeline_figure(
    timeline: Timeline,
    *,
    title: str | None = None,
    max_points: int = 4000,
    unit: Unit = "MiB",
    show_phases: bool = True,
) -> go.Figure:
    """Live memory over time, stacked by category, with the peak marked and the phases shaded.

    One filled step trace per category that is ever non-zero (in ``CATEGORIES`` order, bottom first) and a
    thin ``total`` line; hover shows every category at that time. The first point is the baseline at t=0,
    then one point per event kept by :func:`decimate`, so a 10^6-event timeline stays a figure of < 1 MB
    that draws the exact peak; in exchange, blips shorter than a bucket may be drawn lower than they were.
    Several devices (whose baseline split is known, as in every snapshot) get one panel each with its own
    peak, never one stack summed across GPUs; the title gives their sum. A trace without times
    (``meta["time_unit"] == "event"``) is drawn against the event index and labelled so. A snapshot's
    baseline (blocks live before its trace, of unknown category) is drawn as a dashed line and named so; a
    peak that no event reached (memory never rose above the baseline) is annotated as the baseline, with no time;
    the out-of-memory errors a snapshot's trace logged are dotted red lines on their device. A timeline with
    reserved bytes (a CUDA estimate: :attr:`Timeline.reserved_bytes`) adds a dotted ``reserved`` line above the
    stack: the caching allocator's segments, what ``max_memory_reserved`` counts. One judged against a GPU
    (``memkit.estimate(..., gpu="4090")``: ``meta["usable_bytes"]``) adds a dashed line at what that card's allocator
    can reserve, the low end of its usable spread (what ``fits`` compares the reserved peak with), named for the card.

    Example:
        >>> with memkit.track(model, optimizer=opt, inputs=x) as tl:
        ...     step()
        >>> memkit.plots.timeline_figure(tl, unit="GiB").show()
    """
    div = unit_scale(unit)
    events = timeline.meta.get("time_unit") == "event"
    devices = timeline.devices
    split = len(devices) > 1 and timeline.baseline_by_device is not None
    panels = [timeline.on_device(d) for d in devices] if split else [timeline]
    if split:
        titles = [f"{d}: peak {_fmt(p.peak_bytes / div, unit)}" for d, p in zip(devices, panels, strict=True)]
        fig = make_subplots(rows=len(panels), cols=1, shared_xaxes=True, subplot_titles=titles)
    else:
        fig = go.Figure()
    shown: set[str] = set()
    before = "the trace" if timeline.meta.get("source") == "snapshot" else "tracking"
    t_start = min(0.0, float(timeline.time[0])) if len(timeline) else 0.0
    ooms = [o for o in (timeline.meta.get("out_of_memory") or [])[:_MAX_OOMS] if o.get("time") is not None]
    ooms = [o for o in ooms if o.get("device") in devices and not events]
    # the window ends at the last event or the last out-of-memory error, whose memory was held until then
    t_end = float(timeline.time[-1]) if len(timeline) else 0.0
    t_end = max([t_end, *(float(o["time"]) for o in ooms)])
    instant = t_end <= t_start  # one moment only: plotly would centre it on an axis from -1 to 1
    for row, panel in enumerate(panels, 1):
        where = {"row": row, "col": 1} if split else {}
        x, idx, by_cat = _series(panel, max_points)
        reserved = panel.reserved_bytes
        if reserved is not None:  # never falls without an out-of-memory retry or empty_cache: exact at kept events
            reserved = np.concatenate([[panel.baseline_reserved_bytes], reserved[idx]])
        # a device whose last event came earlier (or never) holds its memory to the end; untimed traces are laid
        # end to end, so a device's level is drawn past its own events only when it has none
        if x[-1] < t_end and (not events or len(panel) == 0):
            x = np.append(x, t_end)
            by_cat = {c: np.append(v, v[-1]) for c, v in by_cat.items()}
            reserved = None if reserved is None else np.append(reserved, reserved[-1])
        x32 = x.astype(np.float32)  # a third smaller figure; float32 still resolves 8 µs at t = 100 s
        for cat in _nonzero_categories(panel):
            color = CATEGORY_COLORS[cat]
            style = {"stackgroup": f"memory{row}", "fillcolor": color, "line": {"width": 0.5, "color": color}}
            legend = {"legendgroup": cat, "showlegend": cat not in shown}
            shown.add(cat)
            fig.add_trace(_step(x32, by_cat[cat] / div, cat, unit, **legend, **style), **where)
        total_name = f"total {devices[row - 1]}" if split else "total"
        total = _step(x32, sum(by_cat.values()) / div, total_name, unit, line={"width": 1, "color": "#333"})
        fig.add_trace(total, **where)
        if reserved is not None:
            line = {"width": 1.5, "color": "#c0392b", "dash": "dot"}
            fig.add_trace(_step(x32, reserved / div, "reserved", unit, line=line), **where)
        if before == "the trace" and panel.baseline_bytes:  # a snapshot's baseline is all "unknown": say what it is
            name, base = f"baseline (live before {before})", panel.baseline_bytes / div
            dash = {"width": 1, "color": "#666", "dash": "dash"}
            legend = {"legendgroup": "baseline", "showlegend": "baseline" not in shown}
            shown.add("baseline")
            ends = np.array([t_start, t_start + 1.0 if instant else t_end], dtype=np.float32)
            fig.add_trace(_step(ends, np.array([base, base]), name, unit, line=dash, **legend), **where)
        peak, t_peak = panel.peak_bytes, panel.peak_time
        marker = {"symbol": "diamond", "size": 10, "color": "#111", "line": {"width": 1, "color": "white"}}
        dot = go.Scatter(x=[t_peak], y=[peak / div], name="peak", mode="markers", marker=marker, showlegend=False)
        fig.add_trace(dot, **where)
        at = f"at event {t_peak:.0f}" if events else f"at {t_peak:.4g} s"
        if panel.peak_index < 0:  # no event holds this peak: no time or index would be true
            at = f"its baseline (live before {before}): never rose above it"
        # a peak that the figure's unit would show as 0.00 (a tiny step judged against a large card) in its own
        shown_in = unit if peak >= div / 100 or not peak else best_unit(peak)
        note = f"peak {_fmt(peak / unit_scale(shown_in), shown_in)} ({peak:,} B)<br>{at}"
        ax = -40 if t_peak > (t_start + t_end) / 2 else 40  # toward the middle: not cut at the figure's edge
        fig.add_annotation(
            x=t_peak, y=peak / div, text=note, arrowhead=2, ax=ax, ay=-36, bgcolor="rgba(255,255,255,0.85)", **where
        )
    if timeline.meta.get("usable_bytes") and not split:
        _capacity(fig, timeline.meta, (t_start, t_start + 1.0 if instant else t_end), div, unit)
    spans = _phase_spans(timeline) if show_phases else []
    if len({name for name, _, _ in spans}) > 1:
        first = {name: i for i, (name, _, _) in reversed(list(enumerate(spans)))}
        rect = {"type": "rect", "xref": "x", "yref": "paper", "y0": 0, "y1": 1, "layer": "below", "line_width": 0}
        shapes = []
        for i, (name, t0, t1) in enumerate(spans):
            # First in the legend, in the order of PHASES. A group each: a horizontal legend stacks a group's
            # entries in a column of their own (four rows, in a short figure).
            # a phase named as a category ("ema": the EMA's update) says which it is: a legend names each once
            shown = f"{name} (phase)" if name in CATEGORIES else name
            legend = {"name": shown, "legendgroup": f"phase {name}", "legendrank": PHASES.index(name)}
            legend["showlegend"] = first[name] == i
            shapes.append({**rect, **legend, "x0": t0, "x1": t1, "fillcolor": PHASE_COLORS[name]})
        fig.update_layout(shapes=shapes)  # one update: add_shape per span is quadratic
    for oom in ooms:  # a snapshot's: where its run failed
        asked = oom.get("requested_bytes")
        text = "out of memory" + (f": asked for {_fmt(asked / div, unit)}" if asked is not None else "")
        where = {"row": devices.index(oom["device"]) + 1, "col": 1} if split else {}
        line = {"color": "#C00000", "width": 1.5, "dash": "dot"}
        fig.add_vline(x=oom["time"], line=line, annotation_text=text, annotation_font_color="#C00000", **where)
    starts = timeline.meta.get("step_starts") or []
    if len(starts) == 2 and not split and 0 < starts[1] < len(timeline):  # an estimate's first and steady step
        at = float(timeline.time[starts[1]])
        fig.add_vline(x=at, line={"color": "#555", "width": 1, "dash": "dash"})
        # named just above the plot, where no line or label of the data can be (the usable bytes' label was)
        for x, text in ((t_start, "first step →"), (at, "steady step →")):
            fig.add_annotation(x=x, y=1, yref="paper", text=text, showarrow=False, xanchor="left", yanchor="bottom")
    title = title or timeline.meta.get("label") or "Memory over the step"
    if split and events:  # untimed traces are laid end to end: their sum is no moment's
        title += f" ({len(devices)} devices, each on its own; their traces have no times)"
    elif split:
        total = _fmt(timeline.peak_bytes / div, unit)
        title += f" ({len(devices)} devices, each on its own; their sum peaked at {total})"
    x_title = "event (the trace has no times)" if events else "time (s)"
    fig.update_xaxes(title_text=x_title, row=len(panels) if split else None, col=1 if split else None)
    if instant:
        fig.update_xaxes(range=[t_start, t_start + 1.0])
    fig.update_yaxes(title_text=f"live memory ({unit})")
    fig.update_layout(title=title, hovermode="x unified", legend_tracegroupgap=6, **_LAYOUT)
    if split:
        fig.update_layout(height=max(450, 260 * len(panels)))
    return fig


def _capacity(fig: go.Figure, meta: dict, ends: tuple[float, float], div: int, unit: str) -> None:
    """The judged card's usable bytes as a dashed line across the window, with its name and its spread."""
    low, high = meta["usable_bytes"]
    name = f"{meta.get('gpu_name') or meta.get('gpu')}: usable"
    spread = f" (usable spread {_fmt(low / div, unit)} to {_fmt(high / div, unit)})" if high != low else ""
    line = {"width": 1.5, "color": "#6a3d9a", "dash": "dash"}
    x, y = np.array(ends, dtype=np.float32), np.array([low, low]) / div
    hover = f"{_fmt(low / div, unit)}{spread}<extra>{name}</extra>"
    fig.add_trace(go.Scatter(x=x, y=y, name=name, mode="lines", line=line, hovertemplate=hover))
    text = f"{name} {_fmt(low / div, unit)}"
    # at the left end, above the line: a step's peak is rarely at its very start, so its label is seldom there
    fig.add_annotation(x=ends[0], y=low / div, text=text, showarrow=False, xanchor="left", yanchor="bottom",
                       font={"color": line["color"], "size": 11})  # fmt: skip


def segments_figure(timeline: Timeline, *, unit: Unit = "MiB") -> go.Figure:
    """What the allocator held when the snapshot was taken, from ``timeline.meta["segments"]`` (a snapshot's
    Timeline): left, each device's reserved memory split by block state (allocated, freed but pending, cached
    and free); right, the number of blocks by size range and state. The whole story of a file without a trace
    (``torch.cuda.memory_snapshot()``), and its fragmentation.

    Example:
        >>> tl = memkit.Timeline.from_snapshot("segments.pickle")
        >>> memkit.plots.segments_figure(tl, unit="GiB").show()
    """
    div = unit_scale(unit)
    segments = timeline.meta.get("segments")
    if not segments:
        raise ValueError("timeline.meta has no 'segments': segments_figure needs a Timeline read from a snapshot")
    fig = make_subplots(
        rows=1,
        cols=2,
        column_widths=[0.45, 0.55],
        horizontal_spacing=0.12,
        subplot_titles=(f"reserved by block state ({unit})", "blocks by size and state (count)"),
    )
    devices = list(segments)
    states = list(_STATE_COLORS) + sorted(
        {st for info in segments.values() for st in info["blocks"]} - set(_STATE_COLORS)
    )
    for state in states:
        values = [segments[d]["blocks"].get(state, {}).get("bytes", 0) / div for d in devices]
        if any(values):
            color = _STATE_COLORS.get(state, "#888")
            hover = f"%{{y}} {state}: %{{x:,.3f}} {unit}<extra></extra>"
            bar = go.Bar(x=values, y=devices, orientation="h", name=state, legendgroup=state, marker_color=color)
            fig.add_trace(bar.update(hovertemplate=hover), 1, 1)
    buckets: dict[str, dict[str, int]] = {}
    for info in segments.values():
        for bucket, by_state in info["blocks_by_size"].items():
            for state, count in by_state.items():
                buckets.setdefault(bucket, {}).setdefault(state, 0)
                buckets[bucket][state] += count
    order = sorted(buckets, key=_bucket_low)
    for state in states:
        counts = [buckets[b].get(state, 0) for b in order]
        if any(counts):
            color = _STATE_COLORS.get(state, "#888")
            bar = go.Bar(x=order, y=counts, name=state, legendgroup=state, showlegend=False, marker_color=color)
            fig.add_trace(bar, 1, 2)
    reserved = sum(info["reserved_bytes"] for info in segments.values())
    n_seg = sum(info["segments"] for info in segments.values())
    fig.update_layout(
        title=f"Allocator segments: {n_seg} segment(s), {_fmt(reserved / div, unit)} reserved",
        barmode="stack",
        **_LAYOUT,
    )
    fig.update_xaxes(type="category", row=1, col=2)
    return fig


def _bucket_low(label: str) -> int:
    if label.startswith("<"):
        return 0
    number, unit = label.split("-")[0], label.split()[-1]
    return int(number) * unit_scale(unit)


def _results(comparison: Any) -> list[tuple[str, Timeline, bool]]:
    rows = []
    for name, result in comparison.results.items():
        if result.timeline is None:
            raise ValueError(f"variant {name!r} has no timeline; comparison_figure needs a tracked step per variant")
        rows.append((name, result.timeline, bool(getattr(result, "passed", True))))
    if not rows:
        raise ValueError("comparison.results is empty")
    return rows


def comparison_figure(comparison: Any, *, unit: Unit = "MiB", max_points: int = 2000) -> go.Figure:
    """Baseline against variants: peak by category (stacked bars) and the total over normalized step time.

    Left: one stacked bar per variant of its peak by category, its total on top and the change vs the baseline
    in %. Right: each variant's ``live_bytes`` total over time scaled to 0..1 so step shapes line up whatever
    their speed (each decimated with ``max_points``, so absolute time is lost; see :func:`timeline_figure`).
    ``comparison`` is a :class:`memkit.Comparison` or anything with ``results`` (name -> result with a
    ``timeline``, baseline first) and ``baseline`` (a name).

    Example:
        >>> cmp = memkit.compare(model, inputs, variants={"ckpt": [memkit.Checkpointing(every=2)]})
        >>> memkit.plots.comparison_figure(cmp, unit="GiB").show()
    """
    div = unit_scale(unit)
    rows = _results(comparison)
    names = [name for name, _, _ in rows]
    baseline = getattr(comparison, "baseline", names[0])
    peaks = [tl.peak_by_category() for _, tl, _ in rows]
    base_peak = sum(peaks[names.index(baseline)].values()) if baseline in names else sum(peaks[0].values())
    bars = min(0.55, 0.3 + 0.04 * len(rows))  # the bars' share of the width: each label needs ~70 px
    fig = make_subplots(
        rows=1,
        cols=2,
        column_widths=[bars, 1 - bars],
        horizontal_spacing=0.1,
        subplot_titles=(f"peak by category ({unit}), change vs baseline", f"live memory over the step ({unit})"),
    )
    for cat in CATEGORIES:
        values = np.array([p[cat] for p in peaks], dtype=np.float64) / div
        if values.any():
            hover = f"%{{y:,.3f}} {unit}<extra>{cat}</extra>"
            color, rank = CATEGORY_COLORS[cat], 100 - CATEGORIES.index(cat)  # legend top-down as they stack
            bar = go.Bar(x=names, y=values, name=cat, marker_color=color, hovertemplate=hover, legendrank=rank)
            bar.update(legendgroup="category", legendgrouptitle_text="peak by category:")
            fig.add_trace(bar, 1, 1)
    for (name, _, passed), peak in zip(rows, peaks, strict=True):
        total = sum(peak.values())
        # Two short lines over a bar as narrow as a fifth of a small figure; what "✗" means is in the title.
        change = "baseline" if name == baseline or not base_peak else f"{(total / base_peak - 1):+.1%}"
        text = f"<b>{_short(total / div, unit)}</b><br>{change}" + ("" if passed else " ✗")
        fig.add_annotation(x=name, y=total / div, text=text, showarrow=False, yanchor="bottom", row=1, col=1)
    for i, (name, tl, _) in enumerate(rows):
        x, _, by_cat = _series(tl, max_points)
        end = x[-1] - x[0]
        xn = ((x - x[0]) / end if end > 0 else np.linspace(0.0, 1.0, len(x))).astype(np.float32)
        color = "#333" if name == baseline else _VARIANT_COLORS[(i - 1) % len(_VARIANT_COLORS)]
        line = {"color": color, "width": 2 if name == baseline else 1.5, "dash": "solid" if name == baseline else "dot"}
        group = {"legendgroup": "variant", "legendgrouptitle_text": "live memory:"}  # lines, not category bands
        fig.add_trace(_step(xn, sum(by_cat.values()) / div, name, unit, line=line, legendrank=200 + i, **group), 1, 2)
    mode = getattr(comparison, "mode", None)
    title = f"Memory: {baseline!r} vs variants" + (f" ({mode})" if mode else "")
    if not all(passed for _, _, passed in rows):
        title += "; ✗: outputs or gradients outside tolerance"
    fig.update_layout(title=title, barmode="stack", hovermode="closest", legend_traceorder="normal", **_LAYOUT)
    for subplot_title in fig.layout.annotations[:2]:  # above the y axis's top tick label, which reaches up ~8 px
        subplot_title.yshift = 10
    top = max(sum(p.values()) for p in peaks) / div
    fig.update_yaxes(title_text=unit, range=[0, 1.25 * top or 1], row=1, col=1)  # room for the annotations
    fig.update_xaxes(type="category", row=1, col=1)
    fig.update_xaxes(title_text="step progress (0 = start, 1 = end)", range=[0, 1], row=1, col=2)
    return fig


def categories_figure(timeline: Timeline, *, unit: Unit = "MiB") -> go.Figure:
    """Horizontal bars of the bytes live at the peak, by category (the non-zero ones), with their share.

    Example:
        >>> with memkit.track(model, inputs=x) as tl:
        ...     model(x)
        >>> memkit.plots.categories_figure(tl).show()
    """
    div = unit_scale(unit)
    peak = {c: v for c, v in timeline.peak_by_category().items() if v}
    total = sum(peak.values()) or 1
    fig = go.Figure(
        go.Bar(
            x=[v / div for v in peak.values()],
            y=list(peak),
            orientation="h",
            marker_color=[CATEGORY_COLORS[c] for c in peak],
            text=[f"{_fmt(v / div, unit)} ({100 * v / total:.0f}%)" for v in peak.values()],
            textposition="outside",
            cliponaxis=False,
            hovertemplate=f"%{{y}}: %{{x:,.3f}} {unit}<extra></extra>",
        )
    )
    fig.update_layout(
        title=f"At the peak: {_fmt(timeline.peak_bytes / div, unit)}",
        xaxis_title=unit,
        yaxis={"autorange": "reversed"},
        xaxis_range=[0, 1.35 * max(peak.values(), default=1) / div],  # room for the labels
        height=max(220, 60 + 40 * len(peak)),
        **_LAYOUT,
    )
    return fig
