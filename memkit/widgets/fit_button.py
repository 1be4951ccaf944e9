"""The Playground's Fit to GPU button: run the plan (``fit.py``) in the background, then set the widgets to its choice.

Each searched dimension has its widget: checkpointing, FF split and quantize their panels (switched on with the plan's
value, or off), the optimizer its menu, the allocator settings their box; the variants switch to ``together`` so that
Estimate shows the configuration as one variant. The status line under the buttons says what was chosen (the flags),
its peak reserved bytes against the GPU's usable bytes, the headroom, how many estimates it took and how long, and
each dimension left out with why. While it searches, the line shows the plan's line for each estimate. When nothing
fits, or the search fails or is stopped, no widget changes. The button is disabled until a GPU is chosen.

Example:
    >>> pg = memkit.Playground(preset="flux", gpu="4090", estimate_size="tiny")
    >>> pg.fit_button.click(); pg.wait()
    >>> pg.last_fit.plan.best.flags, pg.fit_status.value
"""

from __future__ import annotations

import html
from typing import Any

import ipywidgets as widgets

from .. import gpus
from ..units import format_bytes, format_seconds
from .fit import FitResult, FitSettings, fit
from .panels import set_tooltip

__all__ = ["FitButton"]

NO_GPU = "choose a GPU first: Fit to GPU searches for the configuration that fits the GPU menu's card"
TIP = (
    "run memkit.plan on these settings at the estimate size: the fastest checkpointing, FF split, quantize (LoRA), "
    "optimizer (AdamW or 8-bit) and allocator settings whose reserved peak fits the GPU, then set those widgets"
)
_COLORS = {"ok": "#2a7", "stopped": "#b80"}


class FitButton:
    """The button and its status line, driving a :class:`~memkit.widgets.app.Playground`.

    ``button`` and ``status`` are the widgets to lay out; :meth:`start` is the click.
    """

    def __init__(self, playground: Any) -> None:
        self.pg = playground
        self.button = widgets.Button(description="Fit to GPU", icon="compress")
        self.status = widgets.HTML()
        self.button.on_click(lambda _: self.start())
        playground.controls["gpu"].observe(lambda _: self.refresh(), "value")
        self.refresh()

    def refresh(self, busy: bool | None = None) -> None:
        """Enabled when a GPU is chosen and nothing runs (``busy``; None: while Stop is enabled); the tooltip says why
        not."""
        if busy is None:
            busy = not self.pg.stop_button.disabled
        no_gpu = self.pg.state.gpu is None
        self.button.disabled = busy or no_gpu
        set_tooltip(self.button, NO_GPU if no_gpu else TIP)

    def start(self, *, wait: bool = False) -> FitResult | None:
        """Fit (the button). ``wait=True`` runs in this thread and returns the result; else in the background, returning
        None (the result lands in ``playground.last_fit``)."""
        return self.pg._launch(self._work, "fit", wait)

    def _work(self) -> FitResult | None:
        pg, result = self.pg, None
        try:
            result = fit(pg.state, on_progress=self._on_progress)
            if result.ok:
                try:
                    changed = self._apply(result.settings)
                except Exception as e:  # the widgets are as they were (restored)
                    result.status, result.message = "error", f"could not set the widgets: {type(e).__name__}: {e}"
                else:
                    result.notes += changed
            pg.last_fit = result
            self._show(result)
        except Exception as e:  # a bug in drawing the result: say it, keep the app alive
            pg._say(f"could not show the fit: {type(e).__name__}: {e}", "#c33")
        finally:
            pg._busy(False)
        return result

    def _on_progress(self, n: int, at_most: int, line: str) -> None:
        self.pg.progress.value = min(n / at_most, 0.99)
        self.pg.progress_text.value = f"Fit: estimate {n} (at most {at_most})"
        self.status.value = _line(f"Fit to GPU: estimate {n} of at most {at_most}: {line}", "#555")

    # ---- the widgets --------------------------------------------------------------------------------------------
    def _apply(self, settings: FitSettings) -> list[str]:
        """Set the widgets to ``settings``, all or none: a failure restores every widget it touched. Returns a note for
        each widget changed beyond the plan's own (the variants)."""
        pg, c = self.pg, self.pg.controls
        touched = [c["optimizer"], c["alloc_conf"], c["variants"]]
        for name in settings.panels:
            panel = pg.panels[name]
            touched += [panel.choice, *panel.widgets.values(), panel.enabled]
        before = [(w, w.value) for w in touched]
        notes = []
        try:
            c["optimizer"].value = settings.optimizer
            c["alloc_conf"].value = settings.alloc_conf
            if c["variants"].value != "together":
                c["variants"].value = "together"
                notes.append("variants set to together: Estimate shows the configuration as one variant")
            for name, config in settings.panels.items():
                _show_config(pg.panels[name], config)
        except Exception:
            for w, value in before:  # the choices first, then their fields: the panels' own order
                if w.value != value:
                    w.value = value
            raise
        return notes

    def _show(self, result: FitResult) -> None:
        pg = self.pg
        if result.ok:
            pg.progress.bar_style, pg.progress.value = "success", 1.0
            pg.progress_text.value = f"Fit: done in {result.seconds:.1f} s"
            self.status.value = _line(_chosen(result, pg.state), _COLORS["ok"])
        else:
            pg.progress.bar_style = "warning" if result.status == "stopped" else "danger"
            pg.progress_text.value = f"Fit: {result.status}"
            head = "Fit to GPU: nothing changed" if result.status != "refused" else "Fit to GPU refused"
            self.status.value = _line(f"{head}: {result.message}", _COLORS.get(result.status, "#c33"))
        for w in result.warnings:
            pg._say(w, "#b80")


def _show_config(panel: Any, config: Any) -> None:
    """Switch ``panel`` on showing ``config`` (a value of its menu, else field by field), or off for None."""
    if config is None:
        panel.enabled.value = False
        return
    spec = panel.settings.spec
    choice = next((v for v in spec.choices if spec.parse(v) == config), None)
    if choice is not None and panel.choice.value != choice:
        panel.choice.value = choice
    elif choice is None:
        for f in panel.settings.fields:
            panel.widgets[f.name].value = f.widget_value(getattr(config, f.name))
    if panel.settings.config() != config:
        raise ValueError(f"the {spec.name} panel cannot show {config}: it holds {panel.settings.config()}")
    panel.enabled.value = True


def _chosen(result: FitResult, state: Any) -> str:
    """The status line of a fit: the flags, the peak against the usable bytes, headroom, estimates and time, notes."""
    best, card = result.plan.best, gpus.find(state.gpu)
    low, high = card.usable_bytes()
    steps = state.steps
    step = {None: "the larger of the first and the steady step", 1: "first step"}.get(steps, f"step {steps}")
    allocator = f"with {best.alloc_conf}" if best.alloc_conf else "torch's allocator defaults"
    others = len(result.plan.configs) - 1
    rank = "no faster on the roofline" if best.step_seconds is not None else "ranked after it"
    text = (
        f"Fit to GPU, {card.name}: {' '.join(best.flags) or 'nothing switched on'}. Peak "
        f"{format_bytes(best.peak_reserved_bytes)} reserved ({step}, {allocator}) of {format_bytes(low)}–"
        f"{format_bytes(high)} usable: {format_bytes(best.headroom_bytes)} headroom (to the low end). "
        + (
            f"Step time {format_seconds(best.step_seconds)} on its roofline (steady step)"
            + (f", {best.why}" if best.why else "")
            + ". "
            if best.step_seconds is not None
            else ""
        )
        + f"{result.estimates} estimates at {state.estimate_size} size in {result.seconds:.1f} s"
        + (f"; {others} other configurations fit too, {rank}" if others > 0 else "")
        + ". Set: "
        + ", ".join(_set_words(result.settings))
    )
    return text + "".join(f". {n}" for n in result.notes)


def _set_words(settings: FitSettings) -> list[str]:
    words = [str(config) if config is not None else f"{name} off" for name, config in settings.panels.items()]
    return [*words, f"optimizer {settings.optimizer}", f"allocator {settings.alloc_conf or 'defaults'}"]


def _line(text: str, color: str) -> str:
    return f"<div style='font-size:0.9em;margin:2px 0;color:{color}'>{html.escape(text)}</div>"
