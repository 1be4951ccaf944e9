"""``memkit.Playground()``: pick a model and optimizations, run them, watch memory live, read the verdict.

The app is controls around a :class:`~memkit.widgets.state.PlaygroundState`: every widget writes its value into
the state, the buttons call the state's ``run``/``estimate`` in a background thread (so Stop stays clickable),
and the results come back as plain data that ``memkit.plots`` draws. No torch here.

Layout, top to bottom: the model (preset, size, dtype, batch, input sizes, training or inference, optimizer, the
GPU and allocator settings an estimate is judged with); one panel per registered optimization; Run / Estimate /
Fit to GPU / Stop with a progress bar, and Fit's status line (``fit_button.py``: :func:`memkit.plan` on these
settings, its choice set in the widgets); errors and warnings; the GPU verdict and the live timeline of the step
being tracked (after an estimate, its last variant's, with the reserved line and the GPU's usable bytes); the
comparison table (peak by category, time, Δoutput, Δgrad, pass) and the figure of peaks and overlaid timelines.

Example:
    >>> pg = memkit.Playground(preset="flux")
    >>> pg                                      # in JupyterLab or Colab: the app
    >>> pg.state.optimizations["checkpointing"].enabled = True; pg.run(wait=True).comparison.table()
"""

from __future__ import annotations

import html
import numbers
import threading
from collections.abc import Mapping
from typing import Any, Literal

import ipywidgets as widgets

from .. import gpus, plots
from ..optimizers import OPTIMIZERS
from ..units import best_unit
from .figures import FigureMode, figure_mode, make_figure
from .fit import FitResult
from .fit_button import FitButton
from .panels import OptimizationPanel, set_tooltip
from .state import DTYPES, INPUT_SIZES, VARIANT_MODES, PlaygroundState, RunResult
from .verdict import gpu_options, rejudge, verdict_text

__all__ = ["Playground"]

_LABEL_WIDTH = "90px"
# which training steps an estimate measures (PlaygroundState.steps)
STEP_CHOICES = [("first + steady", None), ("first only", 1), ("step 2", 2), ("step 3", 3), ("step 5", 5)]
# PYTORCH_CUDA_ALLOC_CONF offered by the allocator box (empty: torch's defaults; any other text may be typed)
ALLOC_CONFS = ["expandable_segments:True", "max_split_size_mb:512", "garbage_collection_threshold:0.6"]
_VERDICT_COLORS = {"fits": "#2a7", "does not fit": "#c33", "within the spread": "#b80"}
_GRID = "repeat(auto-fill, minmax(260px, 1fr))"
# The figures' heights (px; their width is the output's): the timeline's legend takes 2-3 rows below the time axis
LIVE_HEIGHT, RESULT_HEIGHT = 400, 420
_TABLE_CSS = (
    "<style>.memkit-table table{border-collapse:collapse;font-size:0.85em}"
    ".memkit-table th,.memkit-table td{border:1px solid #ddd;padding:2px 6px;text-align:right;white-space:normal}"
    ".memkit-table th{background:#f5f5f5;overflow-wrap:anywhere}.memkit-table tbody th{text-align:left}</style>"
)


def _cell(v: object) -> str:
    """A table cell: numbers to 4 significant digits, absent values as a dash."""
    if v is None or (isinstance(v, float) and v != v):
        return "–"
    if isinstance(v, numbers.Real) and not isinstance(v, bool):
        return f"{v:,.4g}"
    return str(v)


class Playground:
    """Toggle memkit's optimizations on a transformer, run the step, and compare it with the baseline.

    Run compares the baseline with the enabled optimizations (all together, or each on its own) on real
    tensors at the chosen size (``tiny`` in milliseconds, ``small`` in seconds), drawing the tracked step's
    memory live; Estimate answers the same question for the released full-size model on fake tensors. Errors
    show in the app; Stop ends a run between two ops.

    Args:
        figures: ``"widget"`` (live ``go.FigureWidget``), ``"display"`` (static figures re-displayed, for
            Colab), or ``"auto"`` (:func:`~memkit.widgets.figures.figure_mode`).
        registry: the optimizations to offer (default ``memkit.optimizations.REGISTRY``).
        **settings: :class:`~memkit.widgets.state.PlaygroundState` arguments (``preset="dit"``, ``size``,
            ``dtype``, ``mode``, ``optimizer``...).

    Example:
        >>> pg = memkit.Playground(preset="sd3", mode="training")
        >>> pg          # shows the app; or call pg.run(wait=True) from code
    """

    def __init__(
        self,
        *,
        figures: Literal["auto", "widget", "display"] = "auto",
        registry: Mapping[str, Any] | None = None,
        **settings: Any,
    ) -> None:
        if figures not in ("auto", "widget", "display"):
            raise ValueError(f"figures must be 'auto', 'widget' or 'display', got {figures!r}")
        self.state = PlaygroundState(registry=registry, **settings)
        self.figure_mode: FigureMode = figure_mode() if figures == "auto" else figures
        self.live = make_figure(self.figure_mode, height=LIVE_HEIGHT)
        self.result_figure = make_figure(self.figure_mode, height=RESULT_HEIGHT)
        self.last_result: RunResult | None = None
        self.last_fit: FitResult | None = None
        """What the last Fit to GPU found (:class:`~memkit.widgets.fit.FitResult`)."""
        self._thread: threading.Thread | None = None
        self._build_model_controls()
        self.panels = {name: OptimizationPanel(s) for name, s in self.state.optimizations.items()}
        self._build_actions()
        self.widget = self._layout()

    # ---- controls ---------------------------------------------------------------------------------------
    def _build_model_controls(self) -> None:
        from ..presets import PRESETS

        s = self.state
        c: dict[str, widgets.ValueWidget] = {}
        # grouped: the image models, then the video ones (a Dropdown has no option groups: the label leads with it)
        kinds = {k: "video" if "frames" in p.input_sizes["full"] else "image" for k, p in PRESETS.items()}
        options = [
            (f"{kind} · {k}: {p.description}", k)
            for kind in ("image", "video")
            for k, p in PRESETS.items()
            if kinds[k] == kind
        ]
        c["preset"] = widgets.Dropdown(options=options, value=s.preset, description="model")
        c["size"] = widgets.ToggleButtons(options=["tiny", "small"], value=s.size, description="size")
        c["dtype"] = widgets.Dropdown(options=list(DTYPES), value=s.dtype, description="dtype")
        c["batch_size"] = widgets.BoundedIntText(value=s.batch_size, min=1, max=4096, description="batch")
        for key in INPUT_SIZES:
            c[key] = widgets.Text(value="", description=key.replace("_", " "))
        c["mode"] = widgets.ToggleButtons(options=["training", "inference"], value=s.mode, description="step")
        c["optimizer"] = widgets.Dropdown(
            options=[("none", None), *OPTIMIZERS], value=s.optimizer, description="optimizer"
        )
        c["steps"] = widgets.Dropdown(options=STEP_CHOICES, value=s.steps, description="steps")
        c["grad_accum"] = widgets.BoundedIntText(value=s.grad_accum, min=1, max=256, description="grad accum")
        c["mixed_precision"] = widgets.Dropdown(
            options=[("none", None), "bf16", "fp16"], value=s.mixed_precision, description="mixed prec."
        )
        c["fused_backward"] = widgets.Checkbox(value=s.fused_backward, description="fused backward", indent=False)
        c["optimizer_on"] = widgets.ToggleButtons(
            options=[("device", "device"), ("CPU", "cpu")], value=s.optimizer_on, description="optimizer on"
        )
        c["offload_gradients"] = widgets.Checkbox(
            value=s.offload_gradients, description="offload gradients", indent=False
        )
        placements = [("precomputed", "precomputed"), ("on the GPU", "gpu"), ("on the CPU", "cpu")]
        c["text_encoders"] = widgets.Dropdown(options=placements, value=s.text_encoders, description="text enc.")
        c["vae"] = widgets.Dropdown(options=placements, value=s.vae, description="VAE")
        c["repeats"] = widgets.BoundedIntText(value=s.repeats, min=0, max=50, description="timed steps")
        c["variants"] = widgets.ToggleButtons(options=list(VARIANT_MODES), value=s.variants, description="variants")
        gpu_menu = gpu_options()
        if s.gpu is not None and s.gpu not in [key for _, key in gpu_menu]:  # a size or an alias given in code
            gpu_menu.append((s.gpu, s.gpu))
        c["gpu"] = widgets.Dropdown(options=gpu_menu, value=s.gpu, description="GPU")
        c["alloc_conf"] = widgets.Combobox(
            value=s.alloc_conf, options=ALLOC_CONFS, ensure_option=False, placeholder="torch's defaults",
            description="allocator",
        )  # fmt: skip
        tips = {
            "preset": "a diffusers transformer (or the SD1.5 UNet) with random weights",
            "size": "Run builds this size for real: tiny (milliseconds), small (30-100M parameters, seconds)",
            "dtype": "parameters and inputs",
            "batch_size": "samples per step",
            "mode": "training: forward, loss, backward (and the optimizer); inference: forward under no_grad",
            "optimizer": "training only: its state counts as optimizer_state",
            "steps": "Estimate: first + steady measures the first step and the steady one every later step repeats "
            "(optimizer state, EMA shadows exist), the larger peak being the answer; N measures step N alone. Run "
            "always measures a steady step, after the compared and timed ones",
            "grad_accum": "training: micro-batches per optimizer step; the gradients of the first live through the "
            "others (memkit.Step's grad_accum)",
            "mixed_precision": "fp32 master weights, the forward under autocast (bf16 or fp16 + a gradient scaler); "
            "the trained weights must be float32 (pick dtype float32, or LoRA's fp32 adapters on a lower base)",
            "fused_backward": "training: each parameter updated and its gradient freed in the backward, as soon as "
            "it is accumulated (no full set of gradients at once); not with grad accum > 1 or fp16",
            "optimizer_on": "training: CPU keeps the optimizer's state in CPU memory and steps it there (torchao's "
            "CPUOffloadOptimizer): off the estimate's GPU timeline; not with fused backward",
            "offload_gradients": "with the optimizer on the CPU: each device gradient freed once copied to the host "
            "(torchao's offload_gradients); not with grad accum > 1",
            "text_encoders": "Estimate: where the pipeline's text encoders live (memkit.Pipeline): precomputed (not "
            "loaded, the cached embeddings are the inputs), on the GPU (resident, encoding each batch) or on the CPU "
            "(moved on to encode); the timeline is then the job's training phase, the components beside the step",
            "vae": "Estimate: where the pipeline's VAE lives, as the text encoders",
            "repeats": "Run: untracked steps per variant timed for the 'step (s)' column (0: no timing)",
            "variants": "together: one variant with every enabled optimization; each: one variant per optimization",
            "gpu": "Estimate: judge each variant's peak reserved bytes against this card's usable memory (its total as "
            "torch reports it, less the CUDA context and cuBLAS workspace: memkit.gpus); a dashed line on the timeline",
            "alloc_conf": "Estimate: the PYTORCH_CUDA_ALLOC_CONF the reserved bytes are replayed with; empty: torch's "
            "defaults (expandable_segments:True shows what expandable segments save)",
        }
        for key in INPUT_SIZES:
            tips[key] = f"input {key.replace('_', ' ')}; empty: the preset's default at the size built"
        for key, w in c.items():
            w.style.description_width = _LABEL_WIDTH
            if isinstance(w, widgets.ToggleButtons):
                w.style.button_width = "86px"  # two fit beside the label in a grid cell, "inference" uncut
            w.layout = widgets.Layout(width="auto")  # one each: visibility is set per widget
            set_tooltip(w, tips[key])
            w.observe(lambda change, key=key: self._on_model(key, change["new"]), "value")
        self.controls = c
        self._refresh_model_controls()

    def _on_model(self, key: str, value: Any) -> None:
        s = self.state
        if key in INPUT_SIZES:
            text = str(value).strip()
            s.sizes[key] = None if not text else int(text) if text.isdigit() else text  # the state says what's wrong
        else:
            setattr(s, key, value)
        if key in ("preset", "size", "mode"):
            self._refresh_model_controls()
        if key == "gpu":
            self._rejudge()

    def _refresh_model_controls(self) -> None:
        s, c = self.state, self.controls
        taken, run_sizes, full_sizes = s.input_keys(), s.default_sizes(), s.default_sizes(s.estimate_size)
        for key in INPUT_SIZES:
            c[key].layout.display = None if key in taken else "none"
            if key in taken:
                c[key].placeholder = f"{run_sizes[key]} (run), {full_sizes.get(key, '?')} (estimate)"
        for key in ("optimizer", "grad_accum", "fused_backward", "optimizer_on", "offload_gradients"):
            c[key].disabled = s.mode != "training"

    def _build_actions(self) -> None:
        self.run_button = widgets.Button(description="Run", button_style="primary", icon="play")
        self.estimate_button = widgets.Button(description="Estimate full size", icon="calculator")
        self.stop_button = widgets.Button(description="Stop", button_style="danger", icon="stop", disabled=True)
        set_tooltip(self.run_button, "compare the baseline and the variant(s) on real tensors, at the chosen size")
        set_tooltip(self.estimate_button, "the same settings on the released full-size model, on fake tensors")
        set_tooltip(self.stop_button, "end the run between two ops; the next run starts clean")
        self.run_button.on_click(lambda _: self.run())
        self.estimate_button.on_click(lambda _: self.estimate())
        self.stop_button.on_click(lambda _: self.stop())
        self.progress = widgets.FloatProgress(value=0.0, min=0.0, max=1.0, layout=widgets.Layout(width="260px"))
        self.progress_text = widgets.Label(value="")
        self.fitter = FitButton(self)  # Fit to GPU: memkit.plan on these settings, its choice set in the widgets
        self.fit_button, self.fit_status = self.fitter.button, self.fitter.status
        self.messages = widgets.HTML()
        self.verdict = widgets.HTML()
        self.table = widgets.HTML()

    def _layout(self) -> widgets.Widget:
        from ..optimizations import REGISTRY

        c = self.controls
        order = ["preset", "size", "dtype", "batch_size", *INPUT_SIZES, "mode", "steps", "repeats", "gpu", "alloc_conf"]
        grid = widgets.GridBox([c[k] for k in order], layout=widgets.Layout(grid_template_columns=_GRID))
        # Fine-tuning: the training recipe, and the registry's entries that change what is trained (LoRA)
        tuning = [n for n in self.panels if REGISTRY[n].section == "fine-tuning"]
        self.finetuning_grid = widgets.GridBox(
            [c[k] for k in ("optimizer", "grad_accum", "mixed_precision", "fused_backward", "optimizer_on")]
            + [c["offload_gradients"], c["text_encoders"], c["vae"]]
            + [self.panels[n].view for n in tuning],
            layout=widgets.Layout(grid_template_columns=_GRID, grid_gap="6px"),
        )
        self.panel_grid = widgets.GridBox(
            [p.view for n, p in self.panels.items() if n not in tuning],
            layout=widgets.Layout(grid_template_columns=_GRID, grid_gap="6px"),
        )
        buttons = [self.run_button, self.estimate_button, self.fit_button, self.stop_button]
        actions = widgets.HBox(
            [*buttons, self.progress, self.progress_text],
            layout=widgets.Layout(flex_flow="row wrap", align_items="center"),
        )

        def heading(text: str) -> widgets.HTML:
            return widgets.HTML(f"<b>{html.escape(text)}</b>")

        return widgets.VBox(
            [
                heading("Model"),
                grid,
                heading("Fine-tuning"),
                self.finetuning_grid,
                heading("Optimizations"),
                c["variants"],
                self.panel_grid,
                actions,
                self.fit_status,
                self.messages,
                heading("Live memory of the tracked step"),
                self.verdict,
                self.live.view,
                heading("Comparison"),
                self.table,
                self.result_figure.view,
            ],
            layout=widgets.Layout(width="100%"),
        )

    def _ipython_display_(self) -> None:
        from IPython.display import display

        display(self.widget)
        self.live.attach()
        self.result_figure.attach()

    # ---- running ----------------------------------------------------------------------------------------
    def run(self, *, wait: bool = False) -> RunResult | None:
        """Run (the Run button). ``wait=True`` runs in this thread and returns the result; else in the
        background, returning None (the result lands in ``last_result``)."""
        return self._start("run", wait)

    def estimate(self, *, wait: bool = False) -> RunResult | None:
        """Estimate at full size (the Estimate button); ``wait`` as in :meth:`run`."""
        return self._start("estimate", wait)

    def fit(self, *, wait: bool = False) -> FitResult | None:
        """Fit to GPU (the button): :func:`memkit.plan` on these settings and the GPU chosen, its configuration then set
        in the widgets (``fit_button.py``); ``wait`` as in :meth:`run`, the result in ``last_fit``."""
        return self.fitter.start(wait=wait)

    def stop(self) -> None:
        """Ask the running run to stop (the Stop button)."""
        if self.state.running:
            self.state.request_stop()
            self.progress_text.value = "stopping…"

    def wait(self, timeout: float | None = None) -> RunResult | None:
        """Wait for a background run to end; its result."""
        if self._thread is not None:
            self._thread.join(timeout)
        return self.last_result

    def _start(self, kind: str, wait: bool) -> RunResult | None:
        return self._launch(lambda: self._work(kind), kind, wait)

    def _launch(self, work, name: str, wait: bool):
        """Run ``work`` (Run, Estimate, Fit to GPU) with the buttons busy: in this thread with ``wait`` (its result),
        else in the background (None); refused while another runs."""
        if self.state.running or (self._thread is not None and self._thread.is_alive()):
            self._say("a run is in progress: wait for it to finish or press Stop", "#c33")
            return None
        self._busy(True)
        self.messages.value = ""
        self.progress.value, self.progress.bar_style = 0.0, ""
        if wait:
            return work()
        self._thread = threading.Thread(target=work, name=f"memkit-playground-{name}", daemon=True)
        self._thread.start()
        return None

    def _work(self, kind: str) -> RunResult | None:
        result = None
        try:
            work = self.state.run if kind == "run" else self.state.estimate
            result = work(on_update=self._on_live, on_progress=self._on_progress)
            self.last_result = result
            self._show(result)
        except Exception as e:  # a bug in drawing the result: say it, keep the app alive
            self._say(f"could not show the result: {type(e).__name__}: {e}", "#c33")
        finally:
            self._busy(False)
        return result

    def _busy(self, busy: bool) -> None:
        self.run_button.disabled = self.estimate_button.disabled = busy
        self.stop_button.disabled = not busy
        self.fitter.refresh(busy)

    def _on_progress(self, fraction: float, text: str) -> None:
        self.progress.value = fraction
        self.progress_text.value = text

    def _on_live(self, timeline: Any) -> None:
        label = timeline.meta.get("label") or "step"
        unit = best_unit(timeline.peak_bytes)
        title = f"live: {label} ({len(timeline):,} events)"
        self.live.show(plots.timeline_figure(timeline, title=title, unit=unit, max_points=1500))

    def _say(self, text: str, color: str) -> None:
        box = f"border-left:4px solid {color};padding:4px 8px;margin:4px 0;color:{color}"
        self.messages.value += f"<div style='{box}'>{html.escape(text)}</div>"

    def _show(self, result: RunResult) -> None:
        what = "Run" if result.kind == "run" else "Estimate"
        if result.status == "ok":
            self.progress.bar_style = "success"
            self.progress_text.value = f"{what}: done in {result.seconds:.1f} s"
        elif result.status == "stopped":
            self.progress.bar_style = "warning"
            self.progress_text.value = f"{what}: stopped"
            self._say(result.message, "#b80")
        else:
            self.progress.bar_style = "danger"
            self.progress_text.value = f"{what}: failed"
            self._say(result.message, "#c33")
        for w in result.warnings:
            self._say(w, "#b80")
        if result.ok:
            self._show_comparison(result)
        if result.ok and result.kind == "estimate":
            self._show_estimate_timeline(result)
        self._show_verdict()

    def _show_comparison(self, result: RunResult) -> None:
        cmp = result.comparison
        base = cmp.results[cmp.baseline].timeline
        unit = best_unit(base.peak_bytes)
        df = cmp.table(unit=unit).drop(columns=["optimizations"], errors="ignore").rename_axis(None)
        if "pass" in df.columns:
            df["pass"] = df["pass"].map({True: "✓ pass", False: "✗ fail"})
        # One column per variant, one row per figure (variants are few, figures many: it fits the notebook's
        # width); the unit said once, above the table. Formatted before turning, so every number keeps its format.
        df = df.rename(columns=lambda c: c.removesuffix(f" ({unit})").replace("_", " "))
        df = df.apply(lambda col: col.map(_cell)).T
        note = (
            "Real tensors: every variant ran on the same weights and inputs; pass = outputs and gradients within "
            f"a relative {cmp.tolerance:g} of the baseline."
            if result.kind == "run"
            else f"Estimate on fake tensors, {self.state.estimate_size} size: peaks only (nothing ran to compare)."
        )
        body = df.to_html(border=0)
        self.table.value = (
            f"{_TABLE_CSS}<div style='font-size:0.85em;color:#555'>memory in {unit}: the peak, and each category at "
            f"the peak</div><div class='memkit-table' style='overflow-x:auto;max-width:100%'>{body}</div>"
            f"<div style='font-size:0.85em;color:#555'>{html.escape(note)}</div>"
        )
        fig = plots.comparison_figure(cmp, unit=unit)
        if result.kind == "estimate":
            fig.update_layout(title=f"Estimate, {self.state.preset} ({self.state.estimate_size}): baseline vs variants")
        self.result_figure.show(fig)

    # ---- the GPU verdict -------------------------------------------------------------------------------
    def _estimated(self) -> RunResult | None:
        r = self.last_result
        return r if r is not None and r.ok and r.kind == "estimate" else None

    def _show_estimate_timeline(self, result: RunResult) -> None:
        """The estimate's last variant (the settings being tried; the baseline alone if none) as the timeline,
        now with its reserved line and, judged, the GPU's usable bytes."""
        name, last = list(result.comparison.results.items())[-1]
        tl = last.timeline
        usable = tl.meta.get("usable_bytes") or [0]
        unit = best_unit(max(tl.peak_reserved_bytes or tl.peak_bytes, usable[0]))
        title = f"Estimate, {name}: {self.state.preset} ({self.state.estimate_size}), allocated and reserved"
        self.live.show(plots.timeline_figure(tl, title=title, unit=unit, max_points=1500))

    def _rejudge(self) -> None:
        """A new card for the estimate shown: the same peaks, judged again (no new estimate), and redrawn."""
        result = self._estimated()
        if result is not None and not self.state.running:
            rejudge([r.timeline for r in result.comparison.results.values()], self.state.gpu)
            self._show_estimate_timeline(result)
        self._show_verdict()

    def _show_verdict(self) -> None:
        """One line per variant: fits / does not fit / within the spread of the chosen GPU (``verdict_text``)."""
        s, result = self.state, self._estimated()
        if s.gpu is None:
            self.verdict.value = ""
            return
        lines = []
        for name, r in result.comparison.results.items() if result is not None else ():
            text = verdict_text(r.timeline.meta)
            if text is not None:
                color = _VERDICT_COLORS.get(r.timeline.meta["verdict"], "#333")
                lines.append(f"<div style='color:{color}'><b>{html.escape(name)}</b>: {html.escape(text)}</div>")
        if not lines:
            card = gpus.CATALOG[s.gpu].name if s.gpu in gpus.CATALOG else s.gpu
            lines = [
                f"<div style='color:#555'>{html.escape(card)}: press Estimate full size for the verdict (it judges "
                "an estimate's reserved bytes, the memory a GPU runs out of)</div>"
            ]
        self.verdict.value = f"<div style='font-size:0.9em;margin:2px 0 4px'>{''.join(lines)}</div>"

    def __repr__(self) -> str:
        return f"Playground({self.state!r}, figures={self.figure_mode!r})"
