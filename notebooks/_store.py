"""Make executed notebooks readable where no kernel runs (GitHub's viewer): `make notebooks` runs this after nbconvert.

A live widget's output is only a reference into the kernel's widget state, which GitHub cannot draw: it shows the
widget's repr ("VBox(children=(HTML(...") instead. So each widget output is replaced by the Playground's screenshot
(``screenshots/playground.png``, which the browser test writes from the live app after a Run, at half size) with a
line saying it is a picture, and the notebook's widget state is dropped. Run live, the cell shows
the app itself. A progress bar (``tqdm.auto``'s widget, which memkit's long calls show with ``progress=True``) is
dropped instead: it is there while the cell runs, and a finished cell has nothing to show of it.

A plotly figure is stored as its PNG (``make notebooks`` runs with ``PLOTLY_RENDERER=png+json``). Its plotly JSON
(``application/json``, the figure itself) leaves the notebook for ``figures/<notebook>.json`` beside it, with the
cell it came from and the SHA-256 of the PNG it was drawn as: ``tests/browser/test_figure_layout.py`` draws each
stored figure with plotly.js at 700, 800 and 1400 px and fails on overlapping or clipped text, and
``tests/test_notebook_text.py`` fails when a stored PNG has no such record (a notebook stored without the JSON, or
a record of an older run).

Usage: ``python notebooks/_store.py notebooks/*.ipynb``
"""

from __future__ import annotations

import base64
import hashlib
import io
import json
import re
import sys
from pathlib import Path

WIDGET = "application/vnd.jupyter.widget-view+json"
SCREENSHOT = Path(__file__).resolve().parent / "screenshots" / "playground.png"
FIGURES = "figures"  # folder beside the notebooks: <notebook stem>.json, the figures of that notebook
# tqdm's text form of a bar, what a widget-view output's text/plain holds for it: "desc:  40%|####  | 4/10 [00:02<...]"
PROGRESS = re.compile(r"\d+%\|.*\| *[\d.?]+\w*/[\d.?]+\w* \[")
SCALE = 0.5  # of the screenshot's size: 424 pixels wide, the whole app (controls, buttons, table, timeline)
CAPTION = (
    "The Playground, as a picture: widgets run only in a live Jupyter or Colab kernel (this is the app after a Run, "
    "from the browser test's screenshot). Run the notebook to use it."
)


def _picture() -> str:
    """The screenshot at :data:`SCALE` as base64 PNG (at full size where Pillow is missing)."""
    data = SCREENSHOT.read_bytes()
    try:
        from PIL import Image
    except ImportError:
        return base64.b64encode(data).decode()
    image = Image.open(io.BytesIO(data))
    out = io.BytesIO()
    size = (round(image.width * SCALE), round(image.height * SCALE))
    image.resize(size, Image.LANCZOS).save(out, format="PNG", optimize=True)
    return base64.b64encode(out.getvalue()).decode()


def _progress_bar(output: dict) -> bool:
    data = output.get("data") or {}
    return WIDGET in data and PROGRESS.search("".join(data.get("text/plain", ""))) is not None


def png_sha256(data: dict) -> str:
    """The SHA-256 of an output's PNG (its base64 text as stored, joined when stored as a list of lines)."""
    png = data["image/png"]
    return hashlib.sha256("".join(png).strip().encode()).hexdigest()


def _plotly_figure(data: dict) -> dict | None:
    figure = data.get("application/json")
    if isinstance(figure, dict) and "data" in figure and "layout" in figure and "image/png" in data:
        return figure
    return None


def store(path: Path) -> int:
    """Rewrite ``path`` in place; returns how many widget outputs were replaced (progress bars dropped). Each
    plotly figure's JSON moves to ``figures/<stem>.json`` (rewritten whole; removed when the notebook has none)."""
    nb = json.loads(path.read_text())
    replaced = 0
    picture = None
    figures = []
    for index, cell in enumerate(nb["cells"]):
        if "outputs" in cell:
            cell["outputs"] = [output for output in cell["outputs"] if not _progress_bar(output)]
        for output in cell.get("outputs", []):
            data = output.get("data") or {}
            figure = _plotly_figure(data)
            if figure is not None:
                del data["application/json"]
                figures.append({"cell": index, "png_sha256": png_sha256(data), "figure": figure})
            if WIDGET in data:
                picture = picture or _picture()
                output["data"] = {"image/png": picture, "text/plain": [CAPTION]}
                output.setdefault("metadata", {})
                replaced += 1
    nb["metadata"].pop("widgets", None)
    path.write_text(json.dumps(nb, indent=1, ensure_ascii=False) + "\n")
    record = path.parent / FIGURES / f"{path.stem}.json"
    if figures:
        record.parent.mkdir(exist_ok=True)
        record.write_text(json.dumps({"notebook": path.name, "figures": figures}, separators=(",", ":")) + "\n")
    else:
        record.unlink(missing_ok=True)
    return replaced


if __name__ == "__main__":
    for name in sys.argv[1:]:
        n = store(Path(name))
        if n:
            print(f"{name}: {n} widget output(s) stored as the Playground's screenshot")
