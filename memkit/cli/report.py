"""``memkit report``."""

from __future__ import annotations

import argparse
import html
from pathlib import Path

import torch

import memkit

from ..units import best_unit
from ._common import CLIError, check_preset, check_writable, machine_info, report_variants

_CSS = """
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 1300px; color: #222; }
table { border-collapse: collapse; font-size: 0.9em; }
th, td { border: 1px solid #ccc; padding: 4px 8px; text-align: right; }
th { background: #f4f4f4; }
.machine td, .machine th { text-align: left; }
p.note { color: #555; max-width: 60em; }
"""


def run(args: argparse.Namespace) -> int:
    """``memkit report``: compare the optimizations on a real model, write one HTML file."""
    from tqdm.auto import tqdm

    from ..plots import comparison_figure, timeline_figure

    check_preset(args.preset)
    if args.repeats < 0:
        raise CLIError(f"--repeats must be >= 0, got {args.repeats}")
    check_writable(args.out)
    preset, size = args.preset, args.size

    def model_fn() -> torch.nn.Module:
        return memkit.load_model(preset, size=size)

    variants = report_variants()
    stages = tqdm(total=3, desc="report", unit="stage", disable=args.quiet)
    stages.set_postfix_str(f"compare {len(variants) + 1} runs")
    comparison = memkit.compare(model_fn, variants, mode=args.mode, repeats=args.repeats, progress=not args.quiet)
    stages.update()
    stages.set_postfix_str("figures")
    base = comparison.results[comparison.baseline].timeline
    unit = best_unit(base.peak_bytes)
    figures = [
        ("Peak by category and memory over the step", comparison_figure(comparison, unit=unit)),
        ("Baseline timeline", timeline_figure(base, title=f"baseline: {preset} ({size}), {args.mode}", unit=unit)),
    ]
    parts = [fig.to_html(full_html=False, include_plotlyjs=i == 0) for i, (_, fig) in enumerate(figures)]
    stages.update()
    stages.set_postfix_str("write")
    title = f"memkit report: {preset} ({size}), {args.mode}"
    machine = "".join(f"<tr><th>{html.escape(k)}</th><td>{html.escape(v)}</td></tr>" for k, v in machine_info().items())
    summary = comparison.table(unit=unit)
    table = summary.to_html(float_format=lambda v: f"{v:,.4g}", border=0)
    body = [
        f"<h1>{html.escape(title)}</h1>",
        f"<p class='note'>{html.escape(memkit.PRESETS[preset].description)}, {size} size, random weights. "
        "Every variant ran on the same weights and inputs; memory is the exact tracked peak of one steady step "
        "(after the compared and timed ones: an optimizer's state exists), allocated bytes on the CPU, time "
        f"the median of {args.repeats} untracked step(s) after a warm-up. A variant passes when its output and "
        f"gradients match the baseline within a relative {comparison.tolerance:g}.</p>",
        "<h2>Comparison</h2>",
        table,
    ]
    lower = sorted({op for r in comparison.results.values() for op in r.timeline.meta.get("lower_bound_ops") or ()})
    if lower:
        body.append(
            "<p class='note'><b>Lower bound:</b> these ops allocate buffers inside their kernels that memkit could "
            "neither compute nor learn here (MEMKIT_LEARN_WORKSPACE=0, or a call over MEMKIT_LEARN_MAX_BYTES), so "
            f"the true peaks may be higher: {html.escape(', '.join(lower))}"
            "</p>"
        )
    for (heading, _), part in zip(figures, parts, strict=True):
        body += [f"<h2>{html.escape(heading)}</h2>", part]
    body += ["<h2>Machine</h2>", f"<table class='machine'>{machine}</table>"]
    page = (
        f"<!DOCTYPE html>\n<html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
        f"<style>{_CSS}</style></head><body>\n" + "\n".join(body) + "\n</body></html>\n"
    )
    try:
        Path(args.out).write_text(page, encoding="utf-8")
    except OSError as e:
        raise CLIError(f"could not write {args.out}: {e}", code=1) from None
    stages.update()
    stages.close()
    keep = [c for c in summary.columns if c.startswith(("peak", "step", "time")) or c == "pass"]
    print(summary[keep].to_string(float_format=lambda v: f"{v:,.4g}"))
    print(f"\nwrote {args.out} ({Path(args.out).stat().st_size / 2**20:.1f} MiB, self-contained)")
    return 0


# ---- parser -------------------------------------------------------------------------------------------------
