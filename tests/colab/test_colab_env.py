"""The Playground with Colab's packages (ipywidgets 7, plotly 5): run by ``make colab-test`` in ``.venv-colab``.

There a ``go.FigureWidget`` would show nothing, so the app must take the display-handle path of
``memkit/widgets/figures.py``: this checks it does, with the versions actually installed, and that a run draws
its figures through display handles. Skipped outside that environment (``MEMKIT_COLAB_ENV=1`` marks it).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(
    os.environ.get("MEMKIT_COLAB_ENV") != "1", reason="Colab's versions only: run by `make colab-test`"
)

PINS = Path(__file__).resolve().parents[2] / "constraints-colab.txt"


def _pins() -> dict[str, str]:
    lines = (line.split("#")[0].strip() for line in PINS.read_text().splitlines())
    return dict(line.split("==") for line in lines if line)


def test_the_environment_has_colabs_versions():
    from importlib.metadata import version

    pins = _pins()
    assert {"ipywidgets", "plotly"} <= set(pins)
    assert {name: version(name) for name in pins} == pins


def test_the_playground_draws_through_display_handles_with_colabs_widgets(monkeypatch):
    import IPython.display
    import plotly.graph_objects as go

    import memkit
    from memkit.widgets import figures

    monkeypatch.delenv(figures.ENV, raising=False)
    assert figures.figure_mode() == "display"
    shown = []

    class Handle:
        def update(self, fig):
            shown.append(fig)

    def display(obj, display_id=False):
        shown.append(obj)
        return Handle() if display_id else None

    monkeypatch.setattr(IPython.display, "display", display)
    pg = memkit.Playground(preset="dit", repeats=0, interval=0.01)
    assert pg.figure_mode == "display" and isinstance(pg.live, figures.DisplayFigure)
    pg._ipython_display_()
    assert shown[0] is pg.widget
    pg.panels["checkpointing"].enabled.value = True
    result = pg.run(wait=True)
    assert result.ok, result.message
    assert list(result.comparison.table().index) == ["baseline", "checkpointing:all"]
    figs = shown[1:]
    assert len(figs) > 2 and all(isinstance(f, go.Figure) and not isinstance(f, go.FigureWidget) for f in figs)
    assert "checkpointing:all" in pg.table.value
