"""The Playground: its state object runs the library without a browser, its panels come from the registry.

Runs use tiny presets (milliseconds per step); the test that runs the full-size estimate uses DiT (~5 s).
"""

from __future__ import annotations

import html
import json
import re
import shutil
import subprocess
import threading
import time
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import plotly.graph_objects as go
import pytest
import torch

import memkit
from memkit.optimizations import REGISTRY, Spec
from memkit.widgets import figures as figures_module
from memkit.widgets.fields import panel_fields, type_hints
from memkit.widgets.panels import CUSTOM
from memkit.widgets.state import PlaygroundState

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


# ---- a fake optimization, registered only inside the tests that use it ------------------------------------------
@dataclass(frozen=True, kw_only=True)
class Scale:
    """Scales the first parameter: an optimization that changes the outputs (so a comparison must fail it)."""

    factor: float = 1.0
    """Multiplies the model's first parameter while applied."""
    which: Literal["first", "last"] = "first"
    """Which parameter to scale."""
    loud: bool = False
    """Raise instead of applying (a model this optimization does not support)."""
    oom: bool = False
    """Raise MemoryError while applying (as an allocation that does not fit)."""

    @classmethod
    def parse(cls, value: str) -> Scale:
        return cls(factor=float(value))

    def __str__(self) -> str:
        return f"scale:{self.factor:g}"

    def apply(self, model: torch.nn.Module) -> memkit.Handle:
        if self.loud:
            raise RuntimeError(f"{type(model).__name__} is not supported by scale")
        if self.oom:
            raise MemoryError("cannot allocate 1 TiB")
        params = list(model.parameters())
        p = params[0] if self.which == "first" else params[-1]
        saved = p.detach().clone()
        with torch.no_grad():
            p.mul_(self.factor)

        def undo():
            with torch.no_grad():
                p.copy_(saved)

        return memkit.Handle(undo, name=str(self))


SCALE = Spec(name="scale", config=Scale, summary="test only", metavar="FACTOR", choices=("1", "2"))


@pytest.fixture
def with_scale(monkeypatch):
    """The fake entry in the real registry for one test (the app is built from REGISTRY, untouched)."""
    from memkit import optimizations

    monkeypatch.setitem(optimizations._REGISTRY, "scale", SCALE)
    return SCALE


def _state(**kwargs) -> PlaygroundState:
    kwargs.setdefault("preset", "dit")
    kwargs.setdefault("repeats", 0)
    return PlaygroundState(**kwargs)


# ---- the state object -----------------------------------------------------------------------------------------
def test_run_compares_the_baseline_with_the_configured_variant():
    state = _state(optimizer="sgd")
    settings = state.optimizations["checkpointing"]
    settings.enabled = True
    settings.set("pattern", "every:2")
    progress = []
    result = state.run(on_progress=lambda f, text: progress.append((f, text)))
    assert result.ok, result.message
    cmp = result.comparison
    assert list(cmp.results) == ["baseline", "checkpointing:every:2"]
    assert cmp.results["checkpointing:every:2"].optimizations == [memkit.Checkpointing(pattern="every:2")]
    table = cmp.table()
    assert table["pass"].tolist() == [True, True]
    assert cmp.mode == "training" and cmp.results["baseline"].step.optimizer == "sgd"
    assert table.loc["baseline", "optimizer_state (MiB)"] > 0  # the optimizer the state named ran
    fractions = [f for f, _ in progress]
    assert fractions == sorted(fractions) and fractions[-1] == 1.0 and 0 < len(progress) < 20
    assert any("checkpointing:every:2: tracked step" in text for _, text in progress)


def test_each_optimization_can_be_its_own_variant_and_inference_drops_the_optimizer():
    state = _state(mode="inference", optimizer="adamw", variants="each")
    for name in ("checkpointing", "ff-split"):
        state.optimizations[name].enabled = True
    assert state.step() == memkit.Step(mode="inference")
    result = state.run()
    assert result.ok, result.message
    assert list(result.comparison.results) == ["baseline", "checkpointing:all", "ff-split:4"]
    assert result.comparison.mode == "inference" and "max |Δgrad|" not in result.comparison.table()


def test_a_variant_that_changes_the_outputs_fails(with_scale):
    state = _state()
    state.optimizations["scale"].enabled = True
    state.optimizations["scale"].use("2")
    result = state.run()
    assert result.ok, result.message
    assert result.comparison.table()["pass"].tolist() == [True, False]
    state.optimizations["scale"].set("factor", 1.0)
    assert state.run().comparison.table()["pass"].tolist() == [True, True]


def test_live_updates_arrive_during_the_tracked_step_in_batches():
    interval = 0.01
    state = _state(interval=interval, batch_size=4)  # a step of ~0.1 s: several intervals
    state.optimizations["ff-split"].enabled = True
    seen = []

    def on_update(tl):
        seen.append((time.perf_counter(), tl.meta["label"], len(tl), memkit.memory.tracking(), tl))

    result = state.run(on_update=on_update)
    assert result.ok, result.message
    assert result.updates == len(seen) > 0
    names = list(result.comparison.results)
    assert list(dict.fromkeys(label for _, label, *_ in seen)) == names  # each variant, in order
    for name in names:
        mine = [s for s in seen if s[1] == name]
        final = result.comparison.results[name].timeline
        assert mine[-1][2] == len(final) > 0  # the last update is the step's final state
        live = [s for s in mine if s[3]]
        gaps = [b[0] - a[0] for a, b in zip(live, live[1:], strict=False)]
        assert all(g >= interval / 2 for g in gaps), gaps  # throttled (one call per op: microseconds apart)
        assert len(mine) < len(final) / 5  # batches of events
        sizes = [n for _, _, n, *_ in mine]
        assert sizes == sorted(sizes)
    assert any(tracking for *_, tracking, _ in seen)  # some arrived while a step ran, not only after


def test_stop_ends_the_run_cleanly_and_the_next_run_works():
    state = _state()
    state.optimizations["checkpointing"].enabled = True
    ops = {"n": 0}

    def stop_in_the_tracked_step():  # mid-step: a tracker, hooks and a dispatch mode are live
        ops["n"] += memkit.memory.tracking()
        return ops["n"] > 100

    rng = torch.get_rng_state
    result = state.run(should_stop=stop_in_the_tracked_step)
    assert result.status == "stopped" and "stop" in result.message and result.comparison is None
    assert not memkit.memory.tracking() and torch.get_rng_state is rng
    assert not state.running

    def stop_when_the_variant_starts(fraction, text):
        if text.startswith("checkpointing"):
            state.request_stop()

    result = state.run(on_progress=stop_when_the_variant_starts)
    assert result.status == "stopped"

    state.estimate_size = "tiny"
    ops["n"] = 0
    memkit.estimation.clear_cache()  # a setting estimated before in this process is answered at once: nothing to stop
    result = state.estimate(should_stop=stop_in_the_tracked_step)  # under FakeTensorMode too
    assert result.status == "stopped" and not memkit.memory.tracking()

    result = state.run()
    assert result.ok, result.message
    assert result.comparison.table()["pass"].all()
    assert state.estimate().ok


def test_stops_only_before_aten_ops():
    # prim.device is also queried from C++ that cannot unwind: an exception there aborts the process (FakeTensorMode)
    from torch._subclasses.fake_tensor import FakeTensorMode

    from memkit.widgets._watch import Stopped, _Watch

    watch = _Watch(lambda: True, None, 0.5)
    with FakeTensorMode():
        x = torch.ones(2)
    assert watch.__torch_dispatch__(torch.ops.prim.device.default, (), (x,)) == x.device
    with pytest.raises(Stopped):
        watch.__torch_dispatch__(torch.ops.aten.add.Tensor, (), (x, x))


@pytest.mark.parametrize(
    ("change", "words"),
    [
        (lambda s: setattr(s, "preset", "nope"), ["preset", "nope"]),
        (lambda s: setattr(s, "size", "full"), ["Estimate"]),
        (lambda s: s.sizes.update(height=33, width=33), ["height"]),
        (lambda s: s.sizes.update(height="big"), ["height", "big"]),
        (lambda s: setattr(s, "batch_size", 0), ["batch_size"]),
        (lambda s: _enable(s, "ema", update_every=0), ["ema", "update_every"]),
        (lambda s: _enable(s, "checkpointing", pattern="every:2", budget_bytes="1GiB"), ["checkpointing", "budget"]),
        (lambda s: _enable(s, "checkpointing", budget_bytes="lots"), ["checkpointing", "budget_bytes", "lots"]),
        (lambda s: _enable(s, "fsdp", world_size=0), ["fsdp", "world_size must be an int >= 1, got 0"]),
        (lambda s: _enable(s, "fsdp", world_size="eight"), ["fsdp", "world_size", "'eight'"]),
    ],
)
def test_bad_settings_come_back_as_a_message(change, words):
    state = _state()
    change(state)
    full = words == ["Estimate"]  # estimating at full size is the point of Estimate
    for go_ in (state.run,) if full else (state.run, state.estimate):
        result = go_()
        assert result.status == "error" and result.comparison is None
        assert all(w in result.message for w in words), result.message
    assert not state.running


def _enable(state, name, **values):
    state.optimizations[name].enabled = True
    for k, v in values.items():
        state.optimizations[name].set(k, v)


def test_failures_inside_the_library_come_back_as_messages_and_the_next_run_works(with_scale):
    state = _state()
    scale = state.optimizations["scale"]
    scale.enabled = True
    scale.set("loud", True)
    result = state.run()
    assert result.status == "error" and "not supported by scale" in result.message
    scale.set("loud", False)
    scale.set("oom", True)
    result = state.run()
    assert result.status == "error" and result.message.startswith("out of memory") and "smaller" in result.message
    assert not memkit.memory.tracking()
    scale.set("oom", False)
    assert state.run().ok


def test_a_second_run_while_one_runs_is_refused():
    state = _state()
    inner = []

    def on_progress(fraction, text):
        if not inner:
            inner.append(state.run())

    assert state.run(on_progress=on_progress).ok
    assert inner[0].status == "error" and "in progress" in inner[0].message


def test_a_broken_live_view_is_switched_off_not_the_run():
    state = _state(interval=0.01)
    calls = []

    def broken(tl):
        calls.append(1)
        raise KeyError("draw")

    result = state.run(on_update=broken)
    assert result.ok and len(calls) == 1
    assert any("live view" in w for w in result.warnings)


def test_estimate_runs_the_same_settings_on_fake_tensors():
    state = _state(estimate_size="tiny", optimizer="adamw")
    _enable(state, "ema")
    last = {}
    result = state.estimate(on_update=lambda tl: last.__setitem__(tl.meta["label"], len(tl)))
    assert result.ok, result.message
    cmp = result.comparison
    assert list(cmp.results) == ["baseline", "ema:device"]
    assert last == {name: len(r.timeline) for name, r in cmp.results.items()}  # each step's final state, shown
    assert cmp.results["ema:device"].optimizations == [memkit.EMA()]
    base, ema = (cmp.results[n].timeline for n in cmp.results)
    assert base.meta["estimate"] and base.meta["optimizer"] == "adamw" and base.meta["size"] == "tiny"
    params = base.peak_by_category()["parameter"]
    assert ema.peak_by_category()["ema"] == params > 0  # one more copy of the parameters
    assert "pass" not in cmp.table()  # nothing ran to compare


def test_estimate_defaults_to_the_full_size_model():
    state = _state(mode="inference")
    result = state.estimate()
    assert result.ok, result.message
    tl = result.comparison.results["baseline"].timeline
    assert tl.meta["size"] == "full" and tl.meta["parameters"] > 100 * memkit.load_model("dit").num_parameters()


# ---- panels from the registry -----------------------------------------------------------------------------------
def _other_value(field, current):
    """A widget value different from ``current`` that the field accepts."""
    if field.kind == "bool":
        return not current
    if field.kind == "choice":
        return next(c for c in field.choices if c != current)
    if field.kind == "int":
        return "3" if field.optional else current + 1
    if field.kind == "float":
        return "3.5" if field.optional else (current / 2 if current else 0.5)
    return next(str(c) for c in field.choices if str(c) != current)


@pytest.mark.parametrize("name", sorted(REGISTRY))
def test_every_registry_entry_gets_a_panel_that_builds_its_config(name):
    pg = memkit.Playground(figures="widget")
    spec = REGISTRY[name]
    panel = pg.panels[name]
    fields = panel_fields(spec)
    assert list(panel.widgets) == [f.name for f in fields] == list(spec.panel or panel.widgets)
    hints = type_hints(spec.config)  # FSDP's MixedPrecisionPolicy is imported for type checkers only
    for f in fields:
        w = panel.widgets[f.name]
        assert w.description == f.name and w.tooltip == f.doc and len(f.doc) > 10
        hint = hints[f.name]
        members = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,)
        for literal in (m for m in members if typing.get_origin(m) is Literal):  # the menu offers the type's values
            assert set(typing.get_args(literal)) <= {v for _, v in w.options}
    for value in spec.choices:  # the value menu fills the fields with what the registry value means
        panel.choice.value = value
        assert pg.state.optimizations[name].config() == spec.parse(value)
    panel.choice.value = spec.choices[0]
    panel.enabled.value = True
    assert pg.state.optimizations[name].enabled
    for f in fields:  # every widget reaches the config, one at a time
        w = panel.widgets[f.name]
        old, new = w.value, _other_value(f, w.value)
        w.value = new
        config = pg.state.optimizations[name].config()
        assert getattr(config, f.name) == f.parse(new) != f.parse(old)
        assert panel.choice.value == (pg.state.optimizations[name].choice or CUSTOM)
        assert html.escape(str(config)) in panel.status.value
        w.value = old
        assert pg.state.optimizations[name].config() == spec.parse(spec.choices[0])
        assert panel.choice.value == spec.choices[0]


def test_no_panel_shows_a_control_twice():
    # issue 32: each panel showed a "value" menu beside the fields it repeats (checkpointing: "value" and "pattern")
    pg = memkit.Playground(preset="pixart", estimate_size="tiny", repeats=0, figures="widget")
    for name, panel in pg.panels.items():
        shown = [w for w in panel.view.children if hasattr(w, "description") and w.description]
        labels = [w.description for w in shown]
        assert len(labels) == len(set(labels)), (name, labels)
        assert "value" not in labels, name
        assert (panel.choice in shown) is (not panel.widgets), name  # the whole-value menu only without fields
        assert labels[0] == name and all(f in labels for f in panel.widgets), (name, labels)


@pytest.mark.slow  # several seconds: `make test` and CI run it, the edit-test loop (make test-fast) leaves it out
def test_the_fsdp_panel_shards_the_estimate_and_run_refuses_it():
    pg = memkit.Playground(preset="pixart", estimate_size="tiny", repeats=0, figures="widget")
    panel = pg.panels["fsdp"]
    assert list(panel.widgets) == ["world_size", "reshard_after_forward", "mixed_precision", "cpu_offload"]
    assert [type(w).__name__ for w in panel.widgets.values()] == ["IntText", "Checkbox", "Dropdown", "Checkbox"]
    assert "Estimate only" in panel.view.children[1].value and "Run refuses it" in panel.view.children[1].value
    result = pg.estimate(wait=True)
    assert result.ok, result.message
    alone = result.comparison.results["baseline"].timeline
    panel.enabled.value = True
    peaks, params = {}, {}
    for n in (4, 2):
        panel.widgets["world_size"].value = n
        result = pg.estimate(wait=True)
        assert result.ok, result.message
        sharded = result.comparison.results[f"fsdp:{n}"]
        assert sharded.optimizations == [memkit.FSDP(world_size=n)]
        assert sharded.timeline.meta["parallel"] == f"fsdp:{n}"
        peaks[n] = sharded.timeline.peak_bytes
        params[n] = sharded.timeline.baseline_by_category["parameter"]  # rank 0's shard of the weights
    assert peaks[4] < peaks[2] < alone.peak_bytes  # each GPU's peak, lower with more GPUs
    assert params[4] < params[2] < alone.baseline_by_category["parameter"]
    panel.widgets["world_size"].value = 0
    assert "world_size must be an int &gt;= 1, got 0" in panel.status.value
    panel.widgets["world_size"].value = 4
    result = pg.run(wait=True)
    assert result.status == "error" and "fsdp is estimate-only" in result.message and "Estimate" in result.message
    assert "estimate-only" in pg.messages.value


def test_the_fine_tuning_section_holds_the_recipe_and_lora():
    pg = memkit.Playground(preset="dit", repeats=0, figures="widget")
    c, section = pg.controls, pg.finetuning_grid.children
    recipe = [c[k] for k in ("optimizer", "grad_accum", "mixed_precision", "fused_backward")]
    assert list(section[:4]) == recipe and pg.panels["lora"].view in section  # the registry's section="fine-tuning"
    assert pg.panels["lora"].view not in pg.panel_grid.children and pg.panels["ema"].view in pg.panel_grid.children
    headings = [w.value for w in pg.widget.children if isinstance(w, type(pg.messages)) and w.value.startswith("<b>")]
    assert headings[:3] == ["<b>Model</b>", "<b>Fine-tuning</b>", "<b>Optimizations</b>"]
    assert pg.widget.children.index(pg.finetuning_grid) < pg.widget.children.index(pg.panel_grid)


def test_a_new_registry_entry_gets_its_panel_with_no_app_change(with_scale):
    pg = memkit.Playground(preset="dit", repeats=0, figures="widget")
    panel = pg.panels["scale"]
    assert list(panel.widgets) == ["factor", "which", "loud", "oom"]
    assert [type(w).__name__ for w in panel.widgets.values()] == ["FloatText", "Dropdown", "Checkbox", "Checkbox"]
    assert [v for _, v in panel.widgets["which"].options] == ["first", "last"]
    assert panel.widgets["factor"].tooltip == "Multiplies the model's first parameter while applied."
    assert panel.view in pg.panel_grid.children and pg.panel_grid in pg.widget.children  # laid out with the others
    panel.enabled.value = True
    panel.widgets["factor"].value = 3.0
    panel.widgets["which"].value = "last"
    assert pg.state.optimizations["scale"].config() == Scale(factor=3.0, which="last")
    result = pg.run(wait=True)
    assert result.ok, result.message
    assert "scale:3" in pg.table.value and "✗ fail" in pg.table.value and "✓ pass" in pg.table.value


# ---- the app ----------------------------------------------------------------------------------------------------
def test_the_app_runs_what_its_widgets_say_and_shows_the_comparison():
    pg = memkit.Playground(preset="flux", repeats=0, interval=0.01, figures="widget")
    assert pg.controls["text_len"].layout.display is None
    pg.controls["preset"].value = "dit"
    assert pg.controls["text_len"].layout.display == "none" and pg.controls["height"].layout.display is None
    pg.controls["mode"].value = "inference"
    assert pg.controls["optimizer"].disabled
    pg.controls["mode"].value = "training"
    pg.controls["optimizer"].value = "sgd"
    pg.controls["batch_size"].value = 2
    pg.panels["ff-split"].enabled.value = True
    pg.panels["ff-split"].widgets["splits"].value = 2
    pg.run()  # in the background, as the button does
    result = pg.wait(timeout=60)
    assert result is not None and result.ok, result and result.message
    assert not pg.run_button.disabled and pg.stop_button.disabled
    assert pg.progress.value == 1.0
    table = pg.table.value
    assert "ff-split:2" in table and table.count("✓ pass") == 2 and "max |Δgrad|" in table
    # a column per variant (few), a row per figure (many); the unit once; numbers to 4 significant digits
    head = table[table.index("<thead>") : table.index("</thead>")]
    assert "<th>baseline</th>" in head and "<th>ff-split:2</th>" in head and "peak" not in head
    unit = memkit.units.best_unit(result.comparison.results["baseline"].timeline.peak_bytes)
    assert "<th>optimizer state</th>" in table and f"({unit})" not in table and f"memory in {unit}" in table
    numbers = [c.replace(",", "") for c in re.findall(r"<td>([-\d.,e+]+)</td>", table)]
    digits = [len(re.sub(r"e.*|[-.]", "", n).lstrip("0")) for n in numbers]
    assert len(numbers) > 10 and max(digits) <= 4, numbers
    assert "nan" not in table.lower()
    base = result.comparison.results["baseline"].timeline
    assert base.meta["label"] == "baseline"
    assert pg.live.shown >= 2 and {"total", "parameter"} <= {t.name for t in pg.live.figure.data}
    assert pg.result_figure.shown == 1 and len(pg.result_figure.figure.data) > 2
    # the inputs had the batch the widget set
    assert result.comparison.results["baseline"].timeline.baseline_by_category["input"] > 0
    pg.controls["height"].value = "33"
    result = pg.run(wait=True)
    assert result.status == "error" and "height" in pg.messages.value
    pg.controls["height"].value = ""
    assert pg.run(wait=True).ok and pg.messages.value == ""


def test_the_stop_button_ends_a_background_run():
    pg = memkit.Playground(preset="dit", repeats=50, figures="widget")
    started = threading.Event()
    show = pg._on_progress
    pg._on_progress = lambda f, t: (started.set(), show(f, t))
    pg.run_button.click()
    assert started.wait(30)
    assert pg.run_button.disabled and not pg.stop_button.disabled
    pg.stop_button.click()
    result = pg.wait(timeout=60)
    assert result.status == "stopped"
    assert "stopped" in pg.progress_text.value and not pg.run_button.disabled


def test_figures_fall_back_to_a_display_handle_where_figurewidget_cannot_render(monkeypatch):
    monkeypatch.delenv(figures_module.ENV, raising=False)
    colab = {"plotly_version": "5.24.1", "ipywidgets_version": "7.7.1", "colab": True, "anywidget": False}
    assert figures_module.figure_mode(**colab) == "display"
    assert figures_module.figure_mode(**{**colab, "colab": False}) == "display"  # plotly 5: no anywidget widget
    lab = {"plotly_version": "7.1.0", "ipywidgets_version": "8.1.9", "colab": False, "anywidget": True}
    assert figures_module.figure_mode(**lab) == "widget"
    assert figures_module.figure_mode(**{**lab, "colab": True}) == "display"
    monkeypatch.setenv(figures_module.ENV, "display")
    assert figures_module.figure_mode(**lab) == "display"

    shown = []

    class Handle:
        def update(self, fig):
            shown.append(fig)

    def display(obj, display_id=False):
        shown.append(obj)
        return Handle() if display_id else None

    import IPython.display

    monkeypatch.setattr(IPython.display, "display", display)
    pg = memkit.Playground(preset="dit", repeats=0, interval=0.01)
    assert pg.figure_mode == "display"
    pg._ipython_display_()
    assert shown[0] is pg.widget and len(shown) == 3  # the app, then a figure per handle
    assert pg.run(wait=True).ok
    assert len(shown) > 4 and all(isinstance(f, go.Figure) for f in shown[1:])
    assert shown[-1].layout.title.text.startswith("Memory")  # the comparison replaced the placeholder


def test_a_view_drawn_after_the_updates_starts_from_the_current_figure():
    # A page reload (or a view whose code loaded late) draws from _widget_data/_widget_layout, not from the messages
    pg = memkit.Playground(preset="dit", repeats=0, interval=0.01, figures="widget")
    pg.panels["checkpointing"].enabled.value = True
    assert pg.run(wait=True).ok
    for holder in (pg.live, pg.result_figure):
        w = holder.figure
        assert [(t["name"], len(t["x"])) for t in w._widget_data] == [(t.name, len(t.x)) for t in w.data]
        assert w._widget_layout["title"]["text"] == w.layout.title.text


# The page code of LiveFigureWidget (figures.LOADER_ESM), run in Node against a stand-in for anywidget's side: a
# model with `get`, and a stand-in for plotly's widget module that records what is called. Node imports data: URLs,
# not blob: ones, so `URL.createObjectURL` gives one; `setTimeout` records its delays and fires at once.
LOADER_HARNESS = r"""
const delays = [];
const realSetTimeout = globalThis.setTimeout;
globalThis.setTimeout = (fn, ms) => { delays.push(ms); return realSetTimeout(fn, 0); };
globalThis.Blob = class { constructor(parts) { this.text = parts.join(""); } };
URL.createObjectURL = (blob) => "data:text/javascript;base64," + Buffer.from(blob.text).toString("base64");
URL.revokeObjectURL = () => {};
globalThis.calls = [];
const plotly = `globalThis.calls.push("module evaluated");
export default () => ({
  initialize({ model }) { globalThis.calls.push("initialize " + model.name); },
  render({ el, model }) { globalThis.calls.push("render " + model.name); el.drawn = model.name; return "cleanup"; },
});`;
const model = (name, version, source = plotly) => ({
  name, get: (key) => ({ _plotly_version: version, _plotly_esm: source })[key],
});
const out = {};
const loader = await import("data:text/javascript;base64," + Buffer.from(process.argv[2]).toString("base64"));
const a = loader.default(), b = loader.default(), c = loader.default();
out.initialize_returns = typeof a.initialize({ model: model("a", "7") });  // nothing for anywidget to wait on
b.initialize({ model: model("b", "7") });
c.initialize({ model: model("c", "8", "throw new Error('no plotly here')") });
out.after_initialize = [...calls];  // initialize answered before plotly's module was even started
const el = {}, el_c = {};
out.render = await a.render({ model: model("a", "7"), el });
await b.render({ model: model("b", "7"), el: {} });
await c.render({ model: model("c", "8"), el: el_c });
out.calls = calls;
out.drawn = el.drawn;
out.error_text = el_c.textContent;
out.delays = delays;
console.log(JSON.stringify(out));
"""


def test_live_figure_page_code_answers_at_once_and_draws_when_plotly_has_loaded(tmp_path):
    node = shutil.which("node")
    if node is None:
        pytest.skip("Node.js is not installed: the page code of the live figure cannot be run outside a browser")
    harness = tmp_path / "harness.mjs"
    harness.write_text(LOADER_HARNESS)
    run = subprocess.run(
        [node, str(harness), figures_module.LOADER_ESM], capture_output=True, text=True, timeout=60, check=False
    )
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout)
    assert out["after_initialize"] == [] and out["initialize_returns"] == "undefined"
    # plotly's module evaluated once per version (a, b share it), each model initialized, then drawn by plotly's view
    assert out["calls"] == ["module evaluated", "initialize a", "initialize b", "render a", "render b"]
    assert out["render"] == "cleanup" and out["drawn"] == "a"
    assert "did not load" in out["error_text"] and "no plotly here" in out["error_text"]
    # Started after anywidget's window for the widgets made beside it, read from anywidget's own page code
    window = _anywidget_load_window_ms()
    assert out["delays"] and min(out["delays"]) > window


def _anywidget_load_window_ms() -> int:
    import anywidget

    static = Path(anywidget.__file__).parent / "labextension" / "static"
    found = set()
    for js in static.glob("*.js"):
        text = js.read_text(errors="replace")
        pattern = r"AbortSignal\.timeout\((\d+)\)\.addEventListener\([^)]*\)\s*\{[^}]*Failed to initialize model"
        found |= {int(ms) for ms in re.findall(pattern, text)}
    assert found, f"anywidget's model load timeout not found in {static}"
    return max(found)


def test_the_live_figure_is_plotlys_figurewidget_with_a_small_loader():
    cls = figures_module.live_figure_class()
    assert issubclass(cls, go.FigureWidget) and cls is figures_module.live_figure_class()
    from plotly.basewidget import BaseFigureWidget

    w = cls()
    bundle = str(BaseFigureWidget._esm)
    assert w._plotly_esm == bundle and len(bundle) > 1_000_000  # plotly's widget code rides along, whole
    assert w._esm == figures_module.LOADER_ESM and len(w._esm) < 5_000  # what anywidget must load in its 2 s
    import plotly

    assert w._plotly_version == plotly.__version__
    assert isinstance(figures_module.WidgetFigure().figure, cls)
    plain = figures_module.WidgetFigure(figure_class=go.FigureWidget).figure
    assert isinstance(plain, go.FigureWidget) and not isinstance(plain, cls)


def test_the_optimizer_menu_offers_every_optimizer_a_step_takes():
    pg = memkit.Playground(figures="widget")
    offered = [o[1] if isinstance(o, tuple) else o for o in pg.controls["optimizer"].options]
    assert offered == [None, *memkit.optimizers.OPTIMIZERS]
    pg.controls["optimizer"].value = "adamw8bit"
    assert pg.state.step().optimizer == "adamw8bit"


def test_the_recipe_controls_reach_the_step_and_the_estimate():
    pg = memkit.Playground(figures="widget")
    c = pg.controls
    c["grad_accum"].value = 2
    c["mixed_precision"].value = "bf16"
    step = pg.state.step()
    assert (step.grad_accum, step.mixed_precision, step.fused_backward) == (2, "bf16", False)
    c["grad_accum"].value = 1
    c["fused_backward"].value = True
    c["mixed_precision"].value = None
    assert (pg.state.step().fused_backward, pg.state.step().grad_accum) == (True, 1)
    c["mode"].value = "inference"
    assert c["grad_accum"].disabled and c["fused_backward"].disabled and not c["mixed_precision"].disabled
    assert pg.state.step() == memkit.Step(mode="inference")  # the training-only options drop out
    c["mode"].value = "training"
    state = _state(estimate_size="tiny", optimizer="adamw", grad_accum=2)
    result = state.estimate()
    base = result.comparison.results["baseline"].timeline
    assert base.meta["grad_accum"] == 2
    assert base.peak_bytes == memkit.estimate("dit", size="tiny", grad_accum=2, progress=False).peak_bytes


def test_the_model_dropdown_lists_every_preset_grouped_image_then_video():
    pg = memkit.Playground(preset="dit", repeats=0, figures="widget")
    options = pg.controls["preset"].options
    assert sorted(v for _, v in options) == sorted(memkit.PRESETS)
    kinds = [label.split(" · ")[0] for label, _ in options]
    assert kinds == sorted(kinds, key=("image", "video").index) and {"image", "video"} == set(kinds)
    video = {v for label, v in options if label.startswith("video")}
    assert video == {k for k, p in memkit.PRESETS.items() if "frames" in p.input_sizes["full"]}
    assert {"wan", "hunyuanvideo", "ltx-video"} <= video and "flux" not in video


# ---- the GPU verdict --------------------------------------------------------------------------------------------
GiB = 2**30


def _judged_meta(gpu, peak, **meta):
    """The meta of an estimate whose reserved peak is ``peak``, judged by memkit.gpus.judge against ``gpu``."""
    tl = types.SimpleNamespace(peak_reserved_bytes=peak, meta={"measured": "first and steady", **meta})
    memkit.gpus.judge(tl, memkit.gpus.find(gpu))
    return tl.meta


def test_the_verdict_says_which_card_which_step_and_which_bytes():
    from memkit.widgets.verdict import verdict_text

    low, high = memkit.gpus.find("4090").usable_bytes()
    fits = _judged_meta("4090", low - 3 * GiB, first_step_peak_reserved_bytes=GiB, steady_peak_reserved_bytes=2 * GiB)
    text = verdict_text(fits)
    assert text.startswith("fits on NVIDIA GeForce RTX 4090: 3.00 GiB headroom (steady step, reserved bytes")
    assert "torch's allocator defaults" in text and f"of {low / GiB:.2f}–{high / GiB:.2f} GiB usable" in text
    short = _judged_meta(
        "24GiB", 30 * GiB, measured="steady", steps=3, steady_peak_reserved_bytes=30 * GiB,
        alloc_conf="expandable_segments:True",
    )  # fmt: skip
    card_low, card_high = memkit.gpus.find("24GiB").usable_bytes()
    text = verdict_text(short)
    gap = f"{(30 * GiB - card_high) / GiB:.2f}–{(30 * GiB - card_low) / GiB:.2f} GiB"
    assert text.startswith(f"does not fit on a 24GiB GPU: short by {gap} (step 3, reserved bytes with expandable")
    middle = _judged_meta("h100", (sum(memkit.gpus.find("h100").usable_bytes()) // 2), measured="inference")
    assert verdict_text(middle).startswith("within the spread of NVIDIA H100 80GB HBM3: it may or may not fit")
    assert "(inference pass, reserved bytes" in verdict_text(middle)
    first = _judged_meta("t4", GiB, first_step_peak_reserved_bytes=GiB, steady_peak_reserved_bytes=GiB)
    assert "(first = steady step," in verdict_text(first)
    assert verdict_text({"measured": "first", "peak_reserved_bytes": GiB}) is None  # not judged: nothing to say


def _playground(**settings):
    return memkit.Playground(preset="dit", estimate_size="small", repeats=0, figures="widget", **settings)


def _usable_lines(pg):
    return [t for t in pg.live.figure.data if (t.name or "").endswith(": usable")]


def test_the_gpu_menu_offers_the_catalog_and_its_card_reaches_the_estimate(monkeypatch):
    pg = _playground()
    options = pg.controls["gpu"].options
    assert [key for _, key in options] == [None, *memkit.gpus.CATALOG]
    assert [label for label, _ in options] == ["none", *(g.name for g in memkit.gpus.CATALOG.values())]
    calls, real = [], memkit.estimation.estimate
    monkeypatch.setattr(memkit.estimation, "estimate", lambda *a, **k: calls.append(k) or real(*a, **k))
    memkit.estimation.clear_cache()
    pg.controls["gpu"].value = "4090"
    assert "press Estimate" in pg.verdict.value and "NVIDIA GeForce RTX 4090" in pg.verdict.value
    result = pg.estimate(wait=True)
    assert result.ok, result.message
    assert [k["gpu"] for k in calls] == ["4090"]
    tl = result.comparison.results["baseline"].timeline
    low, high = memkit.gpus.find("4090").usable_bytes()
    assert tl.peak_reserved_bytes < low  # a small DiT: far under a 4090's usable memory
    assert tl.meta["fits"] is True and tl.meta["headroom_bytes"] == low - tl.peak_reserved_bytes
    shown = html.unescape(pg.verdict.value)
    headroom = f"{(low - tl.peak_reserved_bytes) / GiB:.2f} GiB headroom"
    assert f"baseline</b>: fits on NVIDIA GeForce RTX 4090: {headroom}" in shown and "reserved bytes" in shown
    # the timeline: the estimate's reserved line, and the card's usable bytes as a line named for it
    names = [t.name for t in pg.live.figure.data]
    assert "reserved" in names and "total" in names
    (line,) = _usable_lines(pg)
    unit = memkit.units.best_unit(low)
    assert line.name == "NVIDIA GeForce RTX 4090: usable"
    assert list(line.y) == pytest.approx([low / memkit.units.unit_scale(unit)] * 2)
    # the estimate kept for memkit.estimate(preset) is not judged: the card was the Playground's question
    assert "verdict" not in memkit.estimate("dit", size="small", progress=False).meta


def test_a_card_too_small_does_not_fit_and_another_card_judges_the_same_peak_again(monkeypatch):
    pg = _playground(gpu="0.5GiB")  # a size given in code joins the menu
    assert pg.controls["gpu"].value == "0.5GiB"
    result = pg.estimate(wait=True)
    assert result.ok, result.message
    tl = result.comparison.results["baseline"].timeline
    low, high = memkit.gpus.find("0.5GiB").usable_bytes()
    assert tl.peak_reserved_bytes > high  # short even at the spread's high end
    shown = html.unescape(pg.verdict.value)
    gap = f"{(tl.peak_reserved_bytes - high) / GiB:.2f}–{(tl.peak_reserved_bytes - low) / GiB:.2f} GiB"
    assert f"does not fit on a 0.5GiB GPU: short by {gap}" in shown and "#c33" in pg.verdict.value
    # another card: the same peaks judged again, no new estimate; none: no verdict, no capacity line
    monkeypatch.setattr(memkit.estimation, "estimate", lambda *a, **k: pytest.fail("estimated again"))
    pg.controls["gpu"].value = "h100"
    assert tl.meta["gpu"] == "h100" and tl.meta["fits"] is True and "fits on NVIDIA H100" in pg.verdict.value
    (line,) = _usable_lines(pg)
    assert line.name == "NVIDIA H100 80GB HBM3: usable"
    pg.controls["gpu"].value = None
    assert pg.verdict.value == "" and not _usable_lines(pg) and "verdict" not in tl.meta
    assert "reserved" in [t.name for t in pg.live.figure.data]  # the reserved line stays: it is the estimate's


def test_the_allocator_settings_reach_the_estimate_and_a_bad_one_is_a_message():
    pg = _playground()
    assert pg.controls["alloc_conf"].value == "" and "expandable_segments:True" in pg.controls["alloc_conf"].options
    pg.controls["alloc_conf"].value = "expandable_segments:Maybe"
    result = pg.estimate(wait=True)  # does not raise
    assert result.status == "error" and result.comparison is None
    shown = html.unescape(pg.messages.value)
    assert "ValueError" in shown and "'expandable_segments'" in shown and "Maybe" in shown and "Traceback" not in shown
    assert not pg.estimate_button.disabled
    pg.controls["alloc_conf"].value = "expandable_segments:True"
    result = pg.estimate(wait=True)
    assert result.ok, result.message
    tl = result.comparison.results["baseline"].timeline
    assert tl.meta["alloc_conf"] == "expandable_segments:True"
    memkit.estimation.clear_cache()  # the library's own estimates, not the Playground's kept copies
    expandable = memkit.estimate("dit", size="small", alloc_conf="expandable_segments:True", progress=False)
    default = memkit.estimate("dit", size="small", progress=False)
    assert tl.peak_reserved_bytes == expandable.peak_reserved_bytes != default.peak_reserved_bytes
    state = _state(estimate_size="tiny", gpu="rtx9999")  # an unknown card: a message listing the known ones
    result = state.estimate()
    assert result.status == "error" and "unknown gpu 'rtx9999'" in result.message and "4090" in result.message


def test_the_component_placements_reach_the_estimate_as_the_jobs_training_phase():
    from memkit.pipeline import Pipeline, estimate_job

    shown = {}
    for where in ("precomputed", "gpu"):
        state = _state(preset="flux", estimate_size="tiny", optimizer="adamw", text_encoders=where, vae=where)
        result = state.estimate()
        assert result.ok, result.message
        shown[where] = result.comparison.results["baseline"].timeline
    job = estimate_job("flux", Pipeline(text_encoders="gpu", vae="gpu"), size="tiny", progress=False)
    assert shown["gpu"].peak_bytes == job.phases["training"].timeline.peak_bytes > shown["precomputed"].peak_bytes
    resident = sum(job.phases["training"].baseline_by_component[c] for c in job.components[1:])
    assert shown["gpu"].baseline_bytes - shown["precomputed"].baseline_bytes == resident > 0
    assert shown["gpu"].meta["pipeline"] == "text encoders gpu, VAE gpu" and "pipeline" not in shown["precomputed"].meta
    state = _state(preset="dit", estimate_size="tiny", text_encoders="gpu")  # DiT's pipeline has no text encoder
    result = state.estimate()
    assert not result.ok and "has no catalog of pipeline components" in result.message
