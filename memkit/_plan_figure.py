"""The plan's frontier figure (:func:`memkit.plots.plan_figure`): step time against peak reserved memory."""

from __future__ import annotations

from typing import Any

import plotly.graph_objects as go

from .units import Unit, unit_scale

_FITS = {"symbol": "circle", "size": 10, "color": "#1b9e77", "line": {"width": 1, "color": "white"}}
_FAILS = {"symbol": "x", "size": 10, "color": "#C00000"}
_CHOSEN = {"symbol": "star", "size": 20, "color": "rgba(0,0,0,0)", "line": {"width": 2, "color": "#111"}}
_FRONTIER = {"width": 1.5, "color": "#555", "dash": "dot"}
_USABLE = {"width": 1.5, "color": "#6a3d9a", "dash": "dash"}


def _label(candidate: Any) -> str:
    return " ".join(candidate.flags) or "(nothing switched on)"


def plan_figure(plan: Any, *, unit: Unit = "GiB") -> go.Figure:
    """The configurations a :class:`memkit.Plan` timed, as estimated step time (x) against peak reserved memory (y).

    Each timed configuration is a point (a circle if it fits the GPU, a cross if not; hover: its ``memkit estimate``
    flags, time, bytes and headroom); the frontier (:meth:`memkit.Plan.frontier`: none of the others both faster and
    smaller) is a dotted staircase through its points, the least memory any configuration needs at each step time; the
    GPU's usable bytes (the low end of its spread) are a dashed line with its name; the plan's choice (``plan.best``)
    is ringed with a star. Read it left to right: each step down the staircase saves memory at the price of time, and
    the chosen configuration is the leftmost (fastest) timed point under the line. The bytes are each configuration's
    peak reserved bytes (the larger of the first and the steady step, device cuda); the time is
    :mod:`memkit.steptime`'s estimate of the steady step on the plan's GPU. Configurations the plan did not time are
    not drawn (the title counts them).

    Raises a ValueError when no configuration has a step time (``plan.untimed`` says why).

    Example:
        >>> p = memkit.plan("flux", "4090", lora=16)
        >>> memkit.plots.plan_figure(p).show()
    """
    from .plots import _LAYOUT, _fmt

    div = unit_scale(unit)
    frontier = plan.frontier()  # the ValueError saying how to get step times, where there are none
    timed, gpu, best = plan.timed, plan.gpu, plan.best
    fig = go.Figure()
    hover = f"%{{customdata}}<br>%{{x:.4g}} s per step<br>%{{y:,.2f}} {unit} reserved<br>%{{text}}"
    for fits, name, marker in ((True, "fits", _FITS), (False, "does not fit", _FAILS)):
        group = [c for c in timed if c.fits == fits]
        if group:
            headroom = [f"headroom {_fmt(c.headroom_bytes / div, unit)}" for c in group]
            fig.add_trace(go.Scatter(
                x=[c.step_seconds for c in group], y=[c.peak_reserved_bytes / div for c in group], mode="markers",
                name=name, marker=marker, customdata=[_label(c) for c in group], text=headroom,
                hovertemplate=hover + f"<extra>{name}</extra>",
            ))  # fmt: skip
    fig.add_trace(go.Scatter(
        x=[c.step_seconds for c in frontier], y=[c.peak_reserved_bytes / div for c in frontier], mode="lines+markers",
        line_shape="hv", line=_FRONTIER, marker={"size": 4, "color": _FRONTIER["color"]}, hoverinfo="skip",
        name="frontier (no other both faster and smaller)",
    ))  # fmt: skip
    drawn = best is not None and best.step_seconds is not None
    if drawn:
        fig.add_trace(go.Scatter(
            x=[best.step_seconds], y=[best.peak_reserved_bytes / div], mode="markers", marker=_CHOSEN,
            name=f"chosen: {_label(best)}", hovertemplate=f"{_label(best)}<extra>chosen</extra>",
        ))  # fmt: skip
    low, high = gpu.usable_bytes()
    spread = f" (spread to {_fmt(high / div, unit)})" if high != low else ""
    fig.add_hline(
        y=low / div, line=_USABLE, annotation_text=f"{gpu.name}: usable {_fmt(low / div, unit)}{spread}",
        annotation_position="top left", annotation_font_color=_USABLE["color"],
    )  # fmt: skip
    left_out = len(plan.tried) - len(timed)
    title = f"Plan for {gpu.name}: {len(timed)} configurations timed"
    if left_out:
        title += f", {left_out} estimated without a step time (not drawn)"
    if not drawn:
        title += "; the chosen one has no step time"
    top = max(low, *(c.peak_reserved_bytes for c in timed)) / div
    fig.update_layout(title=title, hovermode="closest", **_LAYOUT)
    fig.update_xaxes(title_text=f"estimated step time (s): steady step, on the {gpu.name}")
    fig.update_yaxes(
        title_text=f"peak reserved ({unit}): first/steady step, reserved bytes, cuda",
        range=[0, 1.12 * top],  # from zero, with room for the GPU's label
    )  # fmt: skip
    return fig
