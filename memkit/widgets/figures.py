"""A plotly figure that the app redraws: a ``go.FigureWidget`` updated in place where it renders, else a static
figure re-displayed through an IPython display handle.

``FigureWidget`` needs plotly >= 6 with ipywidgets 8 (it is an anywidget there); in Colab (ipywidgets 7.7, plotly
5) it shows nothing, so there every update replaces a static figure in its output instead: no live zoom, the
same pictures. :func:`figure_mode` decides, ``MEMKIT_PLAYGROUND_FIGURES=widget|display`` overrides it.

Example:
    >>> live = make_figure()              # FigureWidget or display handle, whichever renders here
    >>> live.show(memkit.plots.timeline_figure(tl))
"""

from __future__ import annotations

import copy
import os
import sys
from collections.abc import Callable
from typing import Any, Literal

import ipywidgets as widgets
import plotly.graph_objects as go

__all__ = ["DisplayFigure", "WidgetFigure", "figure_mode", "make_figure"]

FigureMode = Literal["widget", "display"]
ENV = "MEMKIT_PLAYGROUND_FIGURES"


def _major(version: str) -> int:
    try:
        return int(version.split(".")[0])
    except ValueError:
        return 0


def figure_mode(
    *,
    plotly_version: str | None = None,
    ipywidgets_version: str | None = None,
    colab: bool | None = None,
    anywidget: bool | None = None,
) -> FigureMode:
    """``"widget"`` where a ``go.FigureWidget`` renders (plotly >= 6, ipywidgets >= 8, anywidget, not Colab),
    else ``"display"``. Arguments default to this environment (tests pass Colab's versions).

    Example:
        >>> figure_mode(plotly_version="5.24.1", ipywidgets_version="7.7.1", colab=True)
        'display'
    """
    forced = os.environ.get(ENV, "").strip().lower()
    if forced in ("widget", "display"):
        return forced  # type: ignore[return-value]
    if plotly_version is None:
        import plotly

        plotly_version = plotly.__version__
    if ipywidgets_version is None:
        ipywidgets_version = widgets.__version__
    if colab is None:
        colab = "google.colab" in sys.modules
    if anywidget is None:
        try:
            import anywidget as _  # noqa: F401
        except ImportError:
            anywidget = False
        else:
            anywidget = True
    ok = not colab and _major(plotly_version) >= 6 and _major(ipywidgets_version) >= 8 and anywidget
    return "widget" if ok else "display"


def _blank(height: int) -> go.Figure:
    fig = go.Figure()
    fig.update_layout(template="plotly_white", height=height, margin={"t": 30, "b": 30, "l": 40, "r": 20})
    fig.update_xaxes(visible=False)
    fig.update_yaxes(visible=False)
    return fig


def _fit(fig: go.Figure, height: int) -> go.Figure:
    # No fixed width: the figure takes its container's, so legends and titles are not clipped.
    fig.update_layout(width=None, height=height, autosize=True)
    return fig


class WidgetFigure:
    """A ``go.FigureWidget`` whose traces and layout are replaced by each :meth:`show`, in one batched
    message when the traces keep their names and types (a live timeline growing)."""

    mode: FigureMode = "widget"

    def __init__(self, height: int = 420) -> None:
        self.height = height
        self.figure = go.FigureWidget(_blank(height))
        self.view = self.figure
        self.shown = 0

    def show(self, fig: go.Figure) -> None:
        fig = _fit(fig, self.height)
        w = self.figure
        same = [(t.type, t.name) for t in w.data] == [(t.type, t.name) for t in fig.data]
        if same:
            with w.batch_update():
                for old, new in zip(w.data, fig.data, strict=True):
                    old.update(new.to_plotly_json(), overwrite=True)
                w.layout = fig.layout
        else:
            with w.batch_update():
                w.data = []
                w.layout = fig.layout
            w.add_traces(list(fig.data))
        # A view drawn later starts from these two traits, which plotly fills only when the figure itself is
        # displayed (here it is inside the app): without this, reloading the page, or a view whose widget code
        # finished loading after these updates (anywidget loads it asynchronously, and plotly's model misses the
        # messages sent before), shows the blank figure and can never apply the next updates to its traces.
        if w.has_trait("_widget_data"):
            w._widget_data = copy.deepcopy(w._data)
            w._widget_layout = copy.deepcopy(w._layout_obj._props)
        self.shown += 1

    def attach(self) -> None:
        """Nothing to do: the widget is in the app's layout."""


class DisplayFigure:
    """A static figure in an ``Output`` widget, replaced through its display handle by each :meth:`show`.

    The handle is made by :meth:`attach` (the app calls it when it is displayed, in the cell's own thread);
    shows before that are kept and drawn then. ``display`` is ``IPython.display.display`` unless given.
    """

    mode: FigureMode = "display"

    def __init__(self, height: int = 420, display: Callable[..., Any] | None = None) -> None:
        self.height = height
        self.view = widgets.Output()
        self._display = display
        self._handle: Any = None
        self.last: go.Figure = _blank(height)
        self.shown = 0

    def attach(self) -> None:
        display = self._display
        if display is None:
            from IPython.display import display
        with self.view:
            self._handle = display(self.last, display_id=True)

    def show(self, fig: go.Figure) -> None:
        self.last = _fit(fig, self.height)
        self.shown += 1
        if self._handle is not None:
            self._handle.update(self.last)


def make_figure(mode: FigureMode | None = None, *, height: int = 420) -> WidgetFigure | DisplayFigure:
    """A figure holder for ``mode`` (default: :func:`figure_mode`)."""
    mode = mode or figure_mode()
    if mode not in ("widget", "display"):
        raise ValueError(f"mode must be 'widget' or 'display', got {mode!r}")
    return WidgetFigure(height) if mode == "widget" else DisplayFigure(height)
