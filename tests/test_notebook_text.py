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


def test_the_notebook_map_links_every_notebook_and_only_those():
    text = (NOTEBOOKS[0].parent / "README.md").read_text()
    linked = set(re.findall(r"\]\(([^)]+\.ipynb)\)", text))
    assert linked == {p.name for p in NOTEBOOKS}, "notebooks/README.md must link each notebook once it exists"
