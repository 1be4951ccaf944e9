"""One panel per registered optimization, its widgets made from the registry entry's fields (``fields.py``).

A panel edits an :class:`~memkit.widgets.state.OptimizationSettings`: a checkbox turns the optimization on, a
menu picks one of the entry's values (``spec.choices``: ``"all@selective"``...) and fills the fields, and one
widget per field edits it (checkbox, menu, number or text box, chosen by the field's kind; its docstring is the
tooltip). Below, the config those values make (``checkpointing:every:2``) or why they make none. An entry only
estimates take (``spec.estimate_only``: fsdp) says so under its summary.

Example:
    >>> panel = OptimizationPanel(state.optimizations["ema"])
    >>> panel.widgets["update_every"].value = 4     # state.optimizations["ema"].values["update_every"] == 4
"""

from __future__ import annotations

import html
from typing import Any

import ipywidgets as widgets

from .fields import Field, OptimizationSettings

__all__ = ["CUSTOM", "OptimizationPanel", "field_widget", "set_tooltip"]

CUSTOM = "custom"
"""The value menu's entry while the fields match none of the registry's values."""
_STYLE = {"description_width": "110px"}


def set_tooltip(widget: widgets.Widget, text: str) -> None:
    """Hover text on a widget: ``tooltip`` in ipywidgets 8, ``description_tooltip`` in 7."""
    if widget.has_trait("tooltip"):
        widget.tooltip = text
    elif widget.has_trait("description_tooltip"):
        widget.description_tooltip = text


def field_widget(field: Field, value: Any) -> widgets.ValueWidget:
    """The widget that edits ``field``, showing ``value`` (a widget value: see :meth:`Field.widget_value`)."""
    common = {"description": field.name, "style": _STYLE, "layout": widgets.Layout(width="100%")}
    if field.kind == "bool":
        w = widgets.Checkbox(value=bool(value), indent=False, **common)
    elif field.kind == "choice":
        w = widgets.Dropdown(options=list(zip(field.labels, field.choices, strict=True)), value=value, **common)
    elif field.kind == "int" and not field.optional:
        w = widgets.IntText(value=value, **common)
    elif field.kind == "float" and not field.optional:
        w = widgets.FloatText(value=value, **common)
    elif field.kind == "text" and field.choices:
        options = [str(c) for c in field.choices]
        w = widgets.Combobox(value=value, options=options, ensure_option=False, placeholder=options[0], **common)
    else:  # free text, and numbers that may be left empty (None)
        hint = "empty: None" + (", or a size like 8GiB" if field.name.endswith("_bytes") else "")
        w = widgets.Text(value=value, placeholder=hint if field.optional else "", **common)
    set_tooltip(w, field.doc)
    return w


class OptimizationPanel:
    """The widgets of one optimization, kept in step with its settings.

    ``view`` is the panel to lay out; ``enabled``, ``choice`` and ``widgets[field]`` are its controls (``choice``, the
    menu of whole values such as ``"every:2@selective"``, is laid out only for an optimization without fields; it
    stays in step with the fields either way, for code and "Fit to GPU" that set a whole value).
    """

    def __init__(self, settings: OptimizationSettings) -> None:
        self.settings = settings
        spec = settings.spec
        self._syncing = False
        self.enabled = widgets.Checkbox(value=settings.enabled, description=spec.name, indent=False)
        set_tooltip(self.enabled, spec.summary)
        self.choice = widgets.Dropdown(
            options=[*spec.choices, CUSTOM],
            value=settings.choice or CUSTOM,
            description="value",  # the metavar ("PATTERN[@PROVIDER]") did not fit the label: it is in the tooltip
            style=_STYLE,
            layout=widgets.Layout(width="100%"),
        )
        metavar = f"{spec.metavar}: " if getattr(spec, "metavar", "") else ""
        set_tooltip(self.choice, f"{metavar}the values memkit's menus offer for {spec.name}; fills the fields below")
        self.widgets: dict[str, widgets.ValueWidget] = {
            f.name: field_widget(f, settings.values[f.name]) for f in settings.fields
        }
        self.status = widgets.HTML()
        note = "font-size:0.85em;color:#555;line-height:1.3"
        text = html.escape(spec.summary)
        only = getattr(spec, "estimate_only", "")
        if only:  # e.g. fsdp: the estimate shows its per-GPU memory, a real run cannot check it
            text += f"<br><b>Estimate only</b>: Run refuses it ({html.escape(only)})"
        summary = widgets.HTML(f"<div style='{note}'>{text}</div>")
        self.enabled.observe(self._on_enabled, "value")
        self.choice.observe(self._on_choice, "value")
        for name, w in self.widgets.items():
            w.observe(lambda change, name=name: self._on_field(name, change["new"]), "value")
        box = widgets.Layout(border="1px solid #ddd", padding="6px", width="auto")
        # the menu of whole values is shown only where there are no fields: beside them it repeats what they say
        # (checkpointing's "every:2" is its pattern field), and the status line below sums them up
        menu = [] if self.widgets else [self.choice]
        self.view = widgets.VBox([self.enabled, summary, *menu, *self.widgets.values(), self.status], layout=box)
        self._refresh_status()

    def _on_enabled(self, change) -> None:
        self.settings.enabled = bool(change["new"])
        self._refresh_status()

    def _on_choice(self, change) -> None:
        if self._syncing or change["new"] == CUSTOM:
            return
        self.settings.use(change["new"])
        self._syncing = True
        try:
            for f in self.settings.fields:
                self.widgets[f.name].value = self.settings.values[f.name]
        finally:
            self._syncing = False
        self._refresh_status()

    def _on_field(self, name: str, value: Any) -> None:
        if self._syncing:
            return
        self.settings.set(name, value)
        self._syncing = True
        try:
            self.choice.value = self.settings.choice or CUSTOM
        finally:
            self._syncing = False
        self._refresh_status()

    def _refresh_status(self) -> None:
        try:
            text, color = f"→ {self.settings.config()}", "#2a7"
        except ValueError as e:
            text, color = f"✗ {e}", "#c33"
        if not self.settings.enabled:
            color = "#999"
        self.status.value = f"<span style='font-size:0.85em;color:{color}'>{html.escape(text)}</span>"
