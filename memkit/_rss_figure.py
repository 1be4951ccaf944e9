"""The process's resident memory over time (:func:`memkit.plots.rss_figure`): a panel per run, one memory scale."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from .units import Unit, unit_scale


def rss_figure(samples: Mapping[str, Any], *, unit: Unit = "MiB", title: str | None = None) -> go.Figure:
    """The process's RSS over time, one panel per run (``name -> RSSSamples``, or anything with ``times`` in seconds
    and ``bytes``), on one memory axis: levels compare across panels, while each keeps its own time axis, so a run
    ten times shorter than another is not squeezed into a tenth of the width. The subtitle gives each run's peak.

    Example:
        >>> with memkit.memory.sample_rss() as rss:
        ...     model(**inputs)
        >>> memkit.plots.rss_figure({"off": rss}).show()
    """
    from .plots import _LAYOUT, _VARIANT_COLORS, _fmt, _step  # the shared layout (plots imports this module)

    div = unit_scale(unit)
    if not samples:
        raise ValueError("samples is empty: rss_figure needs one RSSSamples (or times and bytes) per run")
    names = list(samples)
    peaks = [max(samples[n].bytes, default=0) / div for n in names]
    titles = [f"{n}: peak {_fmt(p, unit)}" for n, p in zip(names, peaks, strict=True)]
    height = 120 + 170 * len(names)
    # ~70 px between panels for one's time ticks and the next one's title, out of the ~height-180 px of plotting
    fig = make_subplots(rows=len(names), cols=1, subplot_titles=titles, vertical_spacing=70 / (height - 180))
    for row, name in enumerate(names, 1):
        s = samples[name]
        color = _VARIANT_COLORS[(row - 1) % len(_VARIANT_COLORS)]
        trace = _step(np.asarray(s.times), np.asarray(s.bytes) / div, name, unit, line={"color": color, "width": 1.5})
        fig.add_trace(trace.update(showlegend=False), row=row, col=1)
        fig.update_yaxes(title_text=unit, matches="y", row=row, col=1)  # one memory scale for every run
    fig.update_xaxes(title_text="time (s)", row=len(names), col=1)
    fig.update_layout(title=title or "Process RSS", height=height, hovermode="x", **_LAYOUT)
    return fig
