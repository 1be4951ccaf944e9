"""The stored notebooks read as prose: no f-string placeholder ({NAME}, {NAME[1]}) left unformatted in a markdown
cell or a stored output, where a reader on GitHub would see the braces instead of the value."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

NOTEBOOKS = sorted((Path(__file__).resolve().parent.parent / "notebooks").glob("*.ipynb"))
# a name in braces, not LaTeX (^{..}, _{..}, \frac{..}) nor a dict or set literal's lower-case contents
PLACEHOLDER = re.compile(r"(?<![\^_\\A-Za-z}])\{[A-Z_][A-Za-z_0-9]*(?:\[\d+\])?\}")


def _shown_text(cell: dict) -> str:
    text = "".join(cell.get("source", "")) if cell["cell_type"] == "markdown" else ""
    for out in cell.get("outputs", []):
        text += "".join(out.get("text", "")) + "".join((out.get("data") or {}).get("text/plain", ""))
    return text


def test_the_pattern_finds_what_it_names():
    assert PLACEHOLDER.findall("Set batch to {BATCHES[1]} and {SIZE}") == ["{BATCHES[1]}", "{SIZE}"]
    assert not PLACEHOLDER.findall(r"$x^{T}$, a_{N}, \frac{A}{B}, {'a': 1}, {x}")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_no_unformatted_placeholder_is_stored(path):
    cells = json.loads(path.read_text())["cells"]
    holes = [(i, h) for i, cell in enumerate(cells) for h in PLACEHOLDER.findall(_shown_text(cell))]
    assert not holes, f"{path.name}: cell (index) and placeholder shown unformatted: {holes}"


def _needs_the_extra(code: str) -> bool:
    """Code that imports what only memkit's fine-tuning extra installs: peft (LoRA), bitsandbytes (nf4, 8-bit
    optimizers), torchao (the CPU offload optimizer), prodigyopt, came-pytorch."""
    from memkit.optimizers import _LIBRARIES

    names = "|".join(re.escape(n) for n in _LIBRARIES)
    uses = rf"memkit\.(LoRA|Quantize)\(|\blora=|optimizer_on=\"cpu\"|optimizer=\"({names})\""
    return re.search(uses, code) is not None


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_a_notebook_installs_the_extra_its_code_needs(path):
    """On Colab a notebook's guarded %pip line is all that gets installed: a notebook that uses LoRA, a quantized base
    or an optimizer from another library must install memkit[finetune] (notebook 00 did not, and failed there)."""
    code = "".join("".join(c["source"]) for c in json.loads(path.read_text())["cells"] if c["cell_type"] == "code")
    (install,) = re.findall(r'%pip install -q "([^"]+)"', code)
    assert install.startswith("memkit[finetune] @ " if _needs_the_extra(code) else "memkit @ "), (path.name, install)


def test_the_notebook_map_links_every_notebook_and_only_those():
    text = (NOTEBOOKS[0].parent / "README.md").read_text()
    linked = set(re.findall(r"\]\(([^)]+\.ipynb)\)", text))
    assert linked == {p.name for p in NOTEBOOKS}, "notebooks/README.md must link each notebook once it exists"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_no_live_widget_is_stored(path):
    """GitHub cannot draw a widget: it would show its repr ("VBox(children=..."). `make notebooks` stores the
    Playground's screenshot instead (notebooks/_store.py)."""
    nb = json.loads(path.read_text())
    assert "widgets" not in nb["metadata"]
    for cell in nb["cells"]:
        for out in cell.get("outputs", []):
            data = out.get("data") or {}
            assert "application/vnd.jupyter.widget-view+json" not in data
            assert not "".join(data.get("text/plain", "")).startswith(("VBox(", "HBox(")), path.name


def _store_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("_store", NOTEBOOKS[0].parent / "_store.py")
    store = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(store)
    return store


def test_store_replaces_a_widget_output_by_the_screenshot_and_drops_progress_bars(tmp_path):
    store = _store_module()
    widget = {"output_type": "display_data", "metadata": {},
              "data": {store.WIDGET: {"model_id": "x"}, "text/plain": ["VBox(children=(...))"]}}  # fmt: skip
    plain = {"output_type": "stream", "name": "stdout", "text": ["kept\n"]}
    meter = "compare:   0%|          | 0/10 [00:00<?, ?it/s]"  # tqdm.auto's widget, as its text/plain shows it
    bar = {"output_type": "display_data", "metadata": {},
           "data": {store.WIDGET: {"model_id": "y"}, "text/plain": [meter]}}  # fmt: skip
    nb = {"cells": [{"cell_type": "code", "source": [], "metadata": {}, "outputs": [bar, widget, plain, bar]}],
          "metadata": {"widgets": {"state": {}}}, "nbformat": 4, "nbformat_minor": 5}  # fmt: skip
    path = tmp_path / "n.ipynb"
    path.write_text(json.dumps(nb))
    assert store.store(path) == 1
    out = json.loads(path.read_text())
    first, second = out["cells"][0]["outputs"]  # the progress bars dropped
    assert set(first["data"]) == {"image/png", "text/plain"} and "picture" in first["data"]["text/plain"][0]
    assert second == plain and "widgets" not in out["metadata"]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_every_stored_figure_has_its_plotly_record(path):
    """Each stored PNG (but the Playground's screenshot) is a plotly figure whose JSON ``figures/<stem>.json``
    holds, for the same cell and the same PNG, in order: what tests/browser/test_figure_layout.py draws is what
    the notebook shows. Fails for a notebook stored without ``PLOTLY_RENDERER=png+json`` or re-run without
    ``notebooks/_store.py``, and for a figure added, removed or changed since the record was written."""
    store = _store_module()
    nb = json.loads(path.read_text())
    shown = []
    for index, cell in enumerate(nb["cells"]):
        for out in cell.get("outputs", []):
            data = out.get("data") or {}
            if "image/png" in data and not "".join(data.get("text/plain", "")).startswith(store.CAPTION):
                assert "application/json" not in data, f"{path.name} cell {index}: the figure's JSON left in"
                shown.append((index, store.png_sha256(data)))
    record = path.parent / store.FIGURES / f"{path.stem}.json"
    recorded = [(f["cell"], f["png_sha256"]) for f in json.loads(record.read_text())["figures"]] if shown else []
    assert recorded == shown, f"{record.name} does not match {path.name}'s stored figures: run `make notebooks`"
    if not shown:
        assert not record.exists()


def test_store_moves_each_plotly_figure_to_its_record(tmp_path):
    store = _store_module()
    figure = {"data": [{"type": "bar", "y": [1, 2]}], "layout": {"title": {"text": "t"}}}
    plot = {"output_type": "display_data", "metadata": {},
            "data": {"image/png": "iVBORw0KGgo=\n", "application/json": figure, "text/plain": ["Figure"]}}  # fmt: skip
    other = {"output_type": "execute_result", "metadata": {}, "execution_count": 1,
             "data": {"application/json": {"a": 1}, "text/plain": ["{'a': 1}"]}}  # fmt: skip
    nb = {"cells": [{"cell_type": "markdown", "source": [], "metadata": {}},
                    {"cell_type": "code", "source": [], "metadata": {}, "outputs": [other, plot]}],
          "metadata": {}, "nbformat": 4, "nbformat_minor": 5}  # fmt: skip
    path = tmp_path / "n.ipynb"
    path.write_text(json.dumps(nb))
    store.store(path)
    cell = json.loads(path.read_text())["cells"][1]
    assert cell["outputs"][0] == other  # JSON that is not a figure stays
    assert set(cell["outputs"][1]["data"]) == {"image/png", "text/plain"}
    record = json.loads((tmp_path / "figures" / "n.json").read_text())
    entry = {"cell": 1, "png_sha256": store.png_sha256(plot["data"]), "figure": figure}
    assert record == {"notebook": "n.ipynb", "figures": [entry]}
    assert store.png_sha256({"image/png": ["iVBORw0KGgo=\n"]}) == store.png_sha256({"image/png": "iVBORw0KGgo="})
    path.write_text(json.dumps({**nb, "cells": nb["cells"][:1]}))  # the figure gone: its record goes too
    store.store(path)
    assert not (tmp_path / "figures" / "n.json").exists()
