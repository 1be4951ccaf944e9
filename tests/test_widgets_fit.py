"""The Playground's Fit to GPU: memkit.plan on the Playground's settings, its choice set in the widgets, all or none.

The plans run on tiny Flux at 1024x1024 (4,096 image tokens: activations that FF split and checkpointing cut), a full
fine-tune (optimizer, FF split, checkpointing: 8 configurations), against a GPU given as a size whose usable bytes
are picked from estimates made here.
"""

from __future__ import annotations

import html

import pytest

import memkit
from memkit import gpus
from memkit.memory.reserved import replay_reserved
from memkit.planning import ALLOC_CONFS
from memkit.units import format_bytes
from memkit.widgets.fit import FitSettings, plan_arguments
from memkit.widgets.state import PlaygroundState

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

SIZES = dict(height=1024, width=1024)
TOP = dict(optimizations=[memkit.FFSplit(splits=4), memkit.Checkpointing()], optimizer="adamw8bit")
"""Every searched dimension of a full fine-tune at its last level."""


def _estimate(**kwargs):
    return memkit.estimate("flux", size="tiny", progress=False, **SIZES, **kwargs)


def _reserved(tl, conf):
    return replay_reserved(tl, baseline_blocks=tl.baseline_blocks or (), alloc_conf=conf).peak_bytes


def _card(usable: int) -> str:
    """A GPU size string (memkit.gpus.find) whose usable bytes, low end, are ``usable``."""
    probe = gpus.find("1GiB")
    total = (1 << 30) - probe.usable_bytes()[0] + usable
    return f"{total / (1 << 30):.12f}GiB"


def _playground(gpu, **settings):
    pg = memkit.Playground(preset="flux", estimate_size="tiny", repeats=0, figures="widget", gpu=gpu, **settings)
    pg.controls["height"].value, pg.controls["width"].value = str(SIZES["height"]), str(SIZES["width"])
    return pg


def _widget_values(pg):
    values = {key: w.value for key, w in pg.controls.items()}
    for name, panel in pg.panels.items():
        values[name] = (panel.enabled.value, panel.choice.value, {k: w.value for k, w in panel.widgets.items()})
    return values


@pytest.mark.slow  # the plan's estimates of tiny Flux at 1024x1024 and the Playground's own (~10 s)
def test_fit_sets_the_widgets_to_a_configuration_whose_own_estimate_fits_and_is_the_plans_best():
    base, top = _estimate(), _estimate(**TOP)
    assert top.peak_reserved_bytes < base.peak_reserved_bytes
    gpu = _card((base.peak_reserved_bytes + top.peak_reserved_bytes) // 2)  # the baseline does not fit, the top does
    low, high = gpus.find(gpu).usable_bytes()
    pg = _playground(gpu)
    pg.panels["ff-split"].enabled.value = True
    pg.panels["ff-split"].widgets["splits"].value = 2  # a searched dimension: the plan's choice replaces it
    pg.controls["variants"].value = "each"
    lines = []
    pg.fitter._on_progress = lambda n, at_most, line: lines.append((n, at_most, line))
    pg.fit_button.click()  # in the background, as in the app
    pg.wait(timeout=300)
    result = pg.last_fit
    assert result is not None and result.ok, result and result.message
    best = result.plan.best
    # each dimension's widget shows the plan's level
    levels = best.levels
    assert pg.controls["optimizer"].value == levels["optimizer"] and pg.controls["alloc_conf"].value == best.alloc_conf
    assert pg.panels["checkpointing"].enabled.value == (levels["checkpointing"] is not None)
    assert pg.panels["ff-split"].enabled.value == (levels["ff_split"] is not None)
    if levels["ff_split"] is not None:
        assert pg.panels["ff-split"].widgets["splits"].value == levels["ff_split"]
    assert not pg.panels["quantize"].enabled.value and "quantize" not in levels  # a full fine-tune
    assert pg.controls["variants"].value == "together"
    # the Playground's own estimate of those settings: the plan's peak, under the card's usable bytes
    estimate = pg.estimate(wait=True)
    assert estimate.ok, estimate.message
    shown = list(estimate.comparison.results.values())[-1].timeline
    assert shown.peak_reserved_bytes == best.peak_reserved_bytes < low and shown.meta["fits"] is True
    assert shown.peak_reserved_bytes < base.peak_reserved_bytes
    # the status line: the flags, the peak of the usable bytes, the headroom, the estimates; progress per estimate
    status = html.unescape(pg.fit_status.value)
    flags = " ".join(best.flags) or "nothing switched on"
    assert f": {flags}. Peak {format_bytes(shown.peak_reserved_bytes)} reserved" in status
    headroom = format_bytes(low - shown.peak_reserved_bytes)
    assert f"of {format_bytes(low)}–{format_bytes(high)} usable: {headroom} headroom" in status
    assert f"{len(lines)} estimates at tiny size" in status and "quantize not searched (LoRA runs only" in status
    # at most the grid: 2 optimizers x FF split or not x checkpointing none, every 2nd block or all = 12
    assert [n for n, _, _ in lines] == list(range(1, len(lines) + 1)) and all(m == 12 for _, m, _ in lines)
    assert all(line.startswith("estimating ") for _, _, line in lines) and 0 < len(lines) < 12
    assert not pg.fit_button.disabled and pg.progress.value == 1.0


@pytest.mark.slow  # two estimates of tiny Flux at 1024x1024 (~10-20 s in a fresh process: the first builds Flux's code)
def test_when_nothing_fits_no_widget_changes_and_the_message_names_the_smallest_peak():
    top = _estimate(**TOP)
    smallest = min(_reserved(top, conf) for conf in ALLOC_CONFS)
    pg = _playground(_card(smallest // 2))
    pg.panels["checkpointing"].enabled.value = True
    pg.panels["checkpointing"].choice.value = "every:2"
    before = _widget_values(pg)
    result = pg.fit(wait=True)
    assert result.status == "nothing fits" and result.settings is None
    assert _widget_values(pg) == before
    status = html.unescape(pg.fit_status.value)
    assert "nothing changed" in status and f"the smallest peak found is {format_bytes(smallest)} reserved" in status
    assert pg.progress.bar_style == "danger" and not pg.fit_button.disabled


def test_without_a_gpu_fit_is_disabled_and_refused(monkeypatch):
    monkeypatch.setattr(memkit.estimation, "estimate", lambda *a, **k: pytest.fail("estimated without a GPU"))
    pg = _playground(None)
    assert pg.fit_button.disabled and "choose a GPU first" in pg.fit_button.tooltip
    before = _widget_values(pg)
    result = pg.fit(wait=True)  # as a click on the disabled button would, if the browser let it through
    assert result.status == "refused" and "needs a GPU" in result.message
    assert _widget_values(pg) == before and "Fit to GPU refused" in pg.fit_status.value
    pg.controls["gpu"].value = "4090"
    assert not pg.fit_button.disabled and "memkit.plan" in pg.fit_button.tooltip
    pg.controls["gpu"].value = None
    assert pg.fit_button.disabled


@pytest.mark.parametrize(
    "change, words",
    [
        (dict(mode="inference"), "plans a training step"),
        (dict(optimizer="sgd"), "chooses the optimizer among ['adamw', 'adamw8bit']"),
        (dict(text_encoders="gpu"), "set text enc. and VAE to precomputed"),
    ],
)
def test_settings_the_plan_cannot_take_are_refused_before_any_estimate(monkeypatch, change, words):
    monkeypatch.setattr(memkit.estimation, "estimate", lambda *a, **k: pytest.fail("estimated a refused setting"))
    pg = _playground("4090")
    for key, value in change.items():
        pg.controls[key].value = value
    before = _widget_values(pg)
    result = pg.fit(wait=True)
    assert result.status == "refused" and words in result.message
    assert _widget_values(pg) == before


def test_the_plan_gets_the_fixed_settings_and_not_the_searched_ones():
    state = PlaygroundState(preset="flux", estimate_size="tiny", gpu="4090", batch_size=2, grad_accum=2, steps=3)
    state.sizes.update(height=512, frames=9)  # Flux takes no frames: left out as the estimate leaves it
    for name in ("lora", "ema", "checkpointing", "ff-split"):
        state.optimizations[name].enabled = True
    kwargs, notes = plan_arguments(state)
    assert kwargs["optimizations"] == [memkit.LoRA(), memkit.EMA()]  # checkpointing and FF split: searched
    assert kwargs["search"] == ["optimizer", "quantize", "ff_split", "checkpointing"] and notes == []
    assert (kwargs["model"], kwargs["gpu"], kwargs["size"], kwargs["height"]) == ("flux", "4090", "tiny", 512)
    assert (kwargs["batch_size"], kwargs["grad_accum"], kwargs["steps"]) == (2, 2, 3) and "frames" not in kwargs
    mine = {k: v for k, v in memkit.optimizations.REGISTRY.items() if k != "ff-split"}
    kwargs, notes = plan_arguments(PlaygroundState(preset="flux", gpu="4090", registry=mine))  # a full fine-tune
    assert kwargs["search"] == ["optimizer", "checkpointing"]
    assert notes == [
        "ff_split not searched: this Playground has no ff-split panel",
        "quantize not searched (LoRA runs only: switch lora on to search it)",
    ]


def test_the_chosen_settings_reach_every_widget_and_a_failure_restores_them():
    pg = _playground("4090")
    on = FitSettings(
        "adamw8bit", "expandable_segments:True",
        {"quantize": memkit.Quantize(method="nf4"), "ff-split": memkit.FFSplit(splits=4),
         "checkpointing": memkit.Checkpointing(pattern="all")},
    )  # fmt: skip
    pg.fitter._apply(on)
    state = pg.state
    assert (state.optimizer, state.alloc_conf) == ("adamw8bit", "expandable_segments:True")
    assert sorted(map(str, state.configs())) == sorted(map(str, on.panels.values()))
    assert state.configs() == [memkit.Quantize(method="nf4"), memkit.Checkpointing(), memkit.FFSplit(splits=4)]
    before, configs = _widget_values(pg), state.configs()
    unshown = memkit.Checkpointing(blocks="transformer_blocks")  # blocks: no widget edits it
    off = FitSettings("adamw", "", {"quantize": None, "ff-split": None, "checkpointing": unshown})
    with pytest.raises(ValueError, match="the checkpointing panel cannot show"):
        pg.fitter._apply(off)
    assert _widget_values(pg) == before and state.configs() == configs
    pg.fitter._apply(FitSettings("adamw", "", dict.fromkeys(on.panels)))
    assert state.configs() == [] and (state.optimizer, state.alloc_conf) == ("adamw", "")


@pytest.mark.slow  # no estimate runs, but a fresh process imports Flux's code first (~10 s)
def test_stop_ends_the_search_and_changes_nothing():
    pg = _playground("4090")
    before = _widget_values(pg)
    pg.fitter._on_progress = lambda n, at_most, line: pg.stop()  # asked for as the first estimate starts
    result = pg.fit(wait=True)
    assert result.status == "stopped" and "no setting changed" in result.message
    assert _widget_values(pg) == before and pg.progress.bar_style == "warning" and not pg.fit_button.disabled
