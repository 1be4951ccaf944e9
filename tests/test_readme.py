"""The README's library example runs as written (the contract with a new user)."""

import re
from pathlib import Path

import plotly.io as pio
import pytest

pytestmark = pytest.mark.slow  # runs the README's example as written (about a minute)

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_library_example_runs(monkeypatch, capsys):
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert blocks, "the README has a python example"
    monkeypatch.setattr(pio.renderers, "default", "json")  # fig.show() must not try to open a browser
    namespace: dict = {}
    for block in blocks:
        exec(compile(block, str(README), "exec"), namespace)
    timeline, cmp, tl = namespace["timeline"], namespace["cmp"], namespace["tl"]
    assert timeline.peak_bytes > timeline.baseline_bytes
    assert cmp.table()["pass"].all()
    # full Flux in bf16 with AdamW: at least parameters, gradients and two moments (2 bytes each) at once
    assert tl.meta["parameters"] > 11e9
    assert tl.peak_bytes >= 4 * 2 * tl.meta["parameters"]
    steady = namespace["steady"].table()
    assert steady["pass"].all() and steady.loc["ckpt", "max |Δparam|"] == 0.0
