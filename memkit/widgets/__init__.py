"""The Playground: an ipywidgets app that toggles memkit's optimizations, runs a step and shows its memory.

``state.py`` holds the settings and runs them as a plain object (no widgets: tests drive it without a
browser); ``fields.py`` reads what a panel edits from the optimizations' registry; ``panels.py``, ``figures.py``
and ``app.py`` are the widgets. Names are imported on first use, so the state loads without ipywidgets.

Example:
    >>> memkit.Playground()                      # the app, in JupyterLab or Colab
    >>> from memkit.widgets import PlaygroundState
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._lazy import lazy_exports

_EXPORTS = {
    "Playground": ".app",
    "PlaygroundState": ".state",
    "OptimizationSettings": ".fields",
    "RunResult": ".state",
    "Field": ".fields",
    "panel_fields": ".fields",
}

__all__ = ["Field", "OptimizationSettings", "Playground", "PlaygroundState", "RunResult", "panel_fields"]

if TYPE_CHECKING:
    from .app import Playground
    from .fields import Field, OptimizationSettings, panel_fields
    from .state import PlaygroundState, RunResult


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, __all__)
