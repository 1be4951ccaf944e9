"""A plotly figure that the app redraws: a ``go.FigureWidget`` updated in place where it renders, else a static
figure re-displayed through an IPython display handle.

``FigureWidget`` needs plotly >= 6 with ipywidgets 8 (it is an anywidget there); in Colab (ipywidgets 7.7, plotly
5) it shows nothing, so there every update replaces a static figure in its output instead: no live zoom, the
same pictures. :func:`figure_mode` decides, ``MEMKIT_PLAYGROUND_FIGURES=widget|display`` overrides it.

The widget is :class:`LiveFigureWidget`, a ``go.FigureWidget`` whose page code loads plotly's own widget code
without making the page drop updates. anywidget (0.11) gives a new widget's page code 2 s to load, and if it takes
longer it drops every update sent to that widget from then on, for good; plotly's code is a 5 MB module, which a
busy page (a step computing on the same cores, right after Run All displayed the app) parses in more than 2 s: the
figure stays blank forever. Here the code anywidget loads is a few lines that start plotly's module (sent beside it,
parsed once per page) and answer at once; the views wait for it and draw from the latest state.

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

__all__ = ["DisplayFigure", "WidgetFigure", "figure_mode", "live_figure_class", "make_figure"]

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


# The page code anywidget loads for a LiveFigureWidget: plotly's widget module (the `_plotly_esm` trait) is imported
# once per page and version (`globalThis`), without holding up anywidget's start; each view waits for it, then
# plotly's own view draws from the model's state as it is then (the kernel keeps `_widget_data` current).
LOADER_ESM = """
const modules = (globalThis.__memkitPlotlyWidget ??= new Map());
// Parsing plotly's module holds the page for seconds when it is busy; started at once, it would eat into the 2 s
// that anywidget gives the widgets created beside this one (the app makes its figures together). So it starts
// after that window; the views draw then, and later figures find it parsed.
const START_AFTER_MS = 2500;
function plotlyWidget(model) {
  const key = model.get("_plotly_version");
  if (!modules.has(key)) {
    const source = model.get("_plotly_esm");
    const loading = new Promise((resolve) => setTimeout(resolve, START_AFTER_MS)).then(() => {
      const url = URL.createObjectURL(new Blob([source], { type: "text/javascript" }));
      return import(url).finally(() => URL.revokeObjectURL(url));
    });
    modules.set(key, loading);
  }
  return modules.get(key);
}
export default () => {
  let ready;
  return {
    initialize({ model }) {
      // Not awaited: anywidget takes the widget as ready now, so no update sent while plotly loads is dropped.
      ready = plotlyWidget(model).then(async (mod) => {
        const widget = typeof mod.default === "function" ? await mod.default() : mod.default;
        await widget.initialize?.({ model });
        return widget;
      });
      ready.catch((error) => console.error("[memkit] plotly's widget code did not load:", error));
    },
    async render({ model, el, signal }) {
      let widget;
      try {
        widget = await ready;
      } catch (error) {
        el.textContent = "memkit: the figure cannot be drawn (plotly's widget code did not load: " + error + ")";
        return;
      }
      return widget.render({ model, el, signal });
    },
  };
};
"""

_live_class: type | None = None


def live_figure_class() -> type:
    """:class:`LiveFigureWidget`, made on first use (it needs plotly >= 6 and anywidget)."""
    global _live_class
    if _live_class is None:
        import plotly
        import traitlets
        from plotly.basewidget import BaseFigureWidget

        class LiveFigureWidget(go.FigureWidget):
            """A ``go.FigureWidget`` that draws even when the page is too busy to load plotly's widget code in
            anywidget's 2 s (see the module's docs): ``_esm`` is :data:`LOADER_ESM`, plotly's module rides along."""

            _esm = LOADER_ESM
            _plotly_esm = traitlets.Unicode(str(BaseFigureWidget._esm)).tag(sync=True)
            _plotly_version = traitlets.Unicode(plotly.__version__).tag(sync=True)

        LiveFigureWidget.__module__ = __name__
        _live_class = LiveFigureWidget
    return _live_class


def __getattr__(name: str) -> Any:
    if name == "LiveFigureWidget":
        return live_figure_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


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

    def __init__(self, height: int = 420, *, figure_class: type | None = None) -> None:
        self.height = height
        # figure_class: the widget class (default LiveFigureWidget; the browser test compares go.FigureWidget)
        self.figure = (figure_class or live_figure_class())(_blank(height))
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
        # displayed (here it is inside the app): without this, reloading the page, or a view whose plotly code
        # finished loading after these updates (LOADER_ESM: plotly's model listeners start only then), shows the
        # blank figure and can never apply the next updates to its traces.
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
