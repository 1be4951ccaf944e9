"""The ``memkit`` command line: estimate a full-size step, inspect a CUDA memory snapshot, write an HTML report.

Every subcommand calls the library (``memkit.estimate``, ``memory.snapshot.read_snapshot``, ``memkit.compare``)
and only formats what comes back. Bad input (an unknown preset, a pattern an optimization refuses, a corrupted
snapshot) ends with one ``memkit COMMAND: error: ...`` line and exit status 2, never a traceback.

Example:
    $ memkit estimate flux --checkpointing all
    $ memkit inspect snapshot.pickle --top 5
    $ memkit report pixart --out report.html
"""

from __future__ import annotations

import argparse
import datetime
import html
import json
import os
import platform
import shutil
import sys
import textwrap
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

import memkit

from .handle import Optimization
from .units import UNITS, best_unit, format_bytes

__all__ = [
    "OPTIMIZATION_FLAGS",
    "REPORT_VARIANTS",
    "CLIError",
    "OptimizationFlag",
    "build_parser",
    "machine_info",
    "main",
]

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
_SIZE_FLAGS = {"height": "pixels", "width": "pixels", "frames": "video frames", "text_len": "text tokens"}
_CHROMIUM = "/usr/bin/chromium"


class CLIError(Exception):
    """A problem with the user's input or environment: printed as one line, exit status ``code``."""

    def __init__(self, message: str, code: int = 2):
        super().__init__(message)
        self.code = code


# ---- optimizations ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class OptimizationFlag:
    """A command-line switch that adds one optimization to ``memkit estimate``.

    ``build`` receives the parsed value (never ``None`` or ``False``, which mean "off") and returns the
    optimization object; a ``ValueError`` it raises is shown as a clean error naming the flag. A new
    optimization plugs in with one entry in :data:`OPTIMIZATION_FLAGS`, e.g. a switch
    ``OptimizationFlag("--ema", "...", lambda on: memkit.EMA(), {"action": "store_true"})`` or a number
    ``OptimizationFlag("--ff-split", "...", lambda n: memkit.SplitFeedForward(chunks=n), {"type": int})``.
    """

    flag: str
    """The option string, e.g. ``"--checkpointing"``."""
    help: str
    """One line for ``--help``: what it saves and what it costs."""
    build: Callable[[Any], Optimization]
    """Parsed value -> optimization object."""
    argument: Mapping[str, Any] = field(default_factory=dict)
    """Extra ``argparse.add_argument`` keywords (``metavar``, ``type``, ``action``...)."""

    @property
    def dest(self) -> str:
        return self.flag.lstrip("-").replace("-", "_")


OPTIMIZATION_FLAGS: tuple[OptimizationFlag, ...] = (
    OptimizationFlag(
        "--checkpointing",
        "recompute transformer blocks' activations in the backward instead of storing them; PATTERN: 'all'. "
        "Cuts activation memory to about one block's worth for ~20-35%% more step time; nothing in inference",
        lambda pattern: memkit.Checkpointing(pattern),
        {"metavar": "PATTERN"},
    ),
)
"""Optimization switches, applied in this order when several are given (they compose)."""

REPORT_VARIANTS: Mapping[str, Callable[[], list[Optimization]]] = {
    "checkpointing": lambda: [memkit.Checkpointing("all")],
}
"""The variants ``memkit report`` compares against the baseline: name -> fresh list of optimizations."""


def _optimizations(args: argparse.Namespace) -> list[Optimization]:
    built = []
    for spec in OPTIMIZATION_FLAGS:
        value = getattr(args, spec.dest, None)
        if value is None or value is False:
            continue
        try:
            built.append(spec.build(value))
        except (ValueError, TypeError) as e:
            shown = "" if value is True else f" {value}"
            raise CLIError(f"{spec.flag}{shown}: {e}") from None
    return built


# ---- formatting ---------------------------------------------------------------------------------------------
def _fmt_count(n: int) -> str:
    for scale, suffix in ((10**9, "B"), (10**6, "M"), (10**3, "k")):
        if n >= scale:
            return f"{n / scale:.2f} {suffix} ({n:,})"
    return f"{n:,}"


def _rows(rows: Sequence[tuple[str, str]], indent: str = "  ") -> str:
    width = max((len(k) for k, _ in rows), default=0)
    return "\n".join(f"{indent}{k:<{width}}  {v}" for k, v in rows)


def machine_info() -> dict[str, str]:
    """The machine and software a measurement ran on: CPU model, cores, RAM, versions, date."""
    import diffusers
    import psutil

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    cuda = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"
    return {
        "date": datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z"),
        "cpu": cpu,
        "cores": f"{psutil.cpu_count(logical=False) or '?'} physical, {psutil.cpu_count()} logical",
        "ram": f"{psutil.virtual_memory().total / 2**30:.1f} GiB",
        "gpu": cuda,
        "os": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "diffusers": diffusers.__version__,
        "memkit": memkit.__version__,
    }


def _check_writable(path: str | None) -> None:
    """Fail before the long work, not after it, when an output file cannot be written."""
    if path is None:
        return
    folder = Path(path).expanduser().resolve().parent
    if not folder.is_dir():
        raise CLIError(f"cannot write {path}: no folder {folder}")
    if Path(path).is_dir():
        raise CLIError(f"cannot write {path}: it is a folder")


def _write_figure(fig, path: str, *, png: bool = False, what: str = "timeline") -> None:
    """Write a plotly figure as self-contained HTML, or as PNG (kaleido + Chromium)."""
    target = Path(path)
    if png:
        if "BROWSER_PATH" not in os.environ and os.path.exists(_CHROMIUM):
            os.environ["BROWSER_PATH"] = _CHROMIUM
        try:
            import kaleido  # noqa: F401
        except ImportError:
            raise CLIError("PNG export needs kaleido: pip install kaleido (or use --html)", code=1) from None
        try:
            fig.write_image(target, width=1200, height=600)
        except Exception as e:  # kaleido raises its own types when it finds or starts no browser
            raise CLIError(
                f"could not write {what} PNG {path}: {type(e).__name__}: {e}. PNG export needs Chromium "
                "(apt-get install chromium, or set BROWSER_PATH to a Chrome/Chromium binary); --html needs nothing",
                code=1,
            ) from None
    else:
        try:
            fig.write_html(target, include_plotlyjs=True, full_html=True)
        except OSError as e:
            raise CLIError(f"could not write {what} {path}: {e}", code=1) from None


def _check_preset(name: str) -> None:
    if name not in memkit.PRESETS:
        listing = "\n".join(f"  {k:<10} {p.description}" for k, p in memkit.PRESETS.items())
        raise CLIError(f"unknown preset {name!r}; choose one of:\n{listing}")


# ---- estimate -----------------------------------------------------------------------------------------------
def _estimate(args: argparse.Namespace) -> int:
    _check_preset(args.preset)
    optimizations = _optimizations(args)
    training = args.mode == "training"
    optimizer = args.optimizer
    if not training and optimizer not in (None, "none"):
        raise CLIError(f"--optimizer {optimizer} applies to training only; drop it or drop --inference")
    optimizer = (optimizer or "adamw") if training else None
    optimizer = None if optimizer == "none" else optimizer
    sizes = {k: getattr(args, k) for k in _SIZE_FLAGS if getattr(args, k) is not None}
    allowed = memkit.PRESETS[args.preset].input_sizes[args.size]
    unknown = [k for k in sizes if k not in allowed]
    if unknown:
        flags = ", ".join("--" + k.replace("_", "-") for k in unknown)
        accepted = ", ".join("--" + k.replace("_", "-") for k in allowed)
        raise CLIError(f"{flags} does not apply to {args.preset!r}; it takes {accepted}")
    _check_writable(args.html)
    _check_writable(args.png)
    try:
        timeline = memkit.estimate(
            args.preset,
            mode=args.mode,
            optimizations=optimizations,
            dtype=_DTYPES[args.dtype],
            size=args.size,
            optimizer=optimizer,
            steps=args.steps,
            batch_size=args.batch_size,
            device=args.device,
            **sizes,
        )
    except ValueError as e:  # sizes that do not fit the model, an optimization the model refuses
        raise CLIError(str(e)) from None
    meta = timeline.meta
    shape = {**allowed, **sizes}
    result = {
        "preset": args.preset,
        "size": args.size,
        "mode": args.mode,
        "dtype": meta["dtype"],
        "optimizer": optimizer,
        "device": args.device,
        "steps": args.steps,
        "batch_size": args.batch_size,
        "inputs": shape,
        "optimizations": [str(o) for o in optimizations],
        "parameters": meta["parameters"],
        "events": len(timeline),
        "baseline_bytes": timeline.baseline_bytes,
        "peak_bytes": timeline.peak_bytes,
        "peak_by_category": timeline.peak_by_category(),
        "seconds": meta["seconds"],
    }
    out = sys.stderr if args.json else sys.stdout
    if args.html or args.png:
        from .plots import timeline_figure

        title = f"memkit estimate: {args.preset} ({args.size}), {args.mode}, {meta['dtype']}, {args.device}"
        fig = timeline_figure(timeline, title=title, unit=best_unit(timeline.peak_bytes))
        for path, png in ((args.html, False), (args.png, True)):
            if path:
                _write_figure(fig, path, png=png)
                print(f"wrote {path}", file=out)
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    div = UNITS[args.unit]
    num = ",.0f" if args.unit == "B" else ",.3f"
    inputs = [f"{shape['height']}x{shape['width']} px"] if "height" in shape else []
    inputs += [f"{shape['frames']} frames"] if "frames" in shape else []
    inputs += [f"{shape['text_len']} text tokens"] if "text_len" in shape else []
    inputs = ", ".join(inputs)
    print(
        f"memkit estimate: {args.preset} ({args.size}), {args.mode}, {meta['dtype']}, "
        f"optimizer {optimizer or 'none'}, device {args.device}, batch {args.batch_size}, {inputs}"
    )
    print(f"optimizations: {', '.join(result['optimizations']) or 'none'}\n")
    rows = [
        ("parameters", _fmt_count(meta["parameters"])),
        (f"baseline ({args.unit})", f"{timeline.baseline_bytes / div:{num}}"),
        (f"peak ({args.unit})", f"{timeline.peak_bytes / div:{num}}"),
    ]
    rows += [(f"  {c}", f"{v / div:{num}}") for c, v in result["peak_by_category"].items() if v]
    rows.append(("estimated in", f"{meta['seconds']:.1f} s ({len(timeline):,} events)"))
    print(_rows(rows))
    if args.device == "cuda":
        print(
            "\nThe peak compares with torch.cuda.max_memory_allocated(); add the CUDA context (~0.3-0.5 GiB), "
            "cuBLAS workspaces and fragmentation for nvidia-smi."
        )
    return 0


# ---- inspect ------------------------------------------------------------------------------------------------
def _inspect(args: argparse.Namespace) -> int:
    from .memory.snapshot import SnapshotError, read_snapshot

    if args.top < 1:
        raise CLIError(f"--top must be >= 1, got {args.top}")
    _check_writable(args.html)
    try:
        timeline = read_snapshot(args.snapshot)
    except FileNotFoundError:
        raise CLIError(f"no such file: {args.snapshot}") from None
    except (SnapshotError, IsADirectoryError, PermissionError) as e:
        raise CLIError(str(e)) from None
    meta = timeline.meta
    unit = "s" if meta.get("time_unit", "s") == "s" else "events"
    top = timeline.top_allocations(args.top) if timeline.peak_index >= 0 else []
    if args.html:
        from .plots import timeline_figure

        fig = timeline_figure(timeline, title=f"memkit inspect: {Path(args.snapshot).name}")
        _write_figure(fig, args.html)
        print(f"wrote {args.html}", file=sys.stderr if args.json else sys.stdout)
    if args.json:
        summary = timeline.summary()
        summary.update(devices=timeline.devices, time_unit=unit, top=top)
        for key in ("reserved_bytes", "allocated_bytes", "unaccounted_bytes"):
            if key in meta:
                summary[key] = meta[key]
        print(json.dumps(summary, indent=2))
        return 0
    rows = [
        ("events", f"{len(timeline):,}"),
        ("devices", ", ".join(timeline.devices) or "none"),
        ("baseline", f"{format_bytes(timeline.baseline_bytes)} ({timeline.baseline_bytes:,} B)"),
        ("peak", f"{format_bytes(timeline.peak_bytes)} ({timeline.peak_bytes:,} B)"),
        ("peak at", f"{timeline.peak_time:.4g} {unit}" + ("" if unit == "s" else " (the trace has no times)")),
    ]
    rows += [(f"  {c}", format_bytes(v)) for c, v in timeline.peak_by_category().items() if v]
    for key, label in (("reserved_bytes", "reserved"), ("allocated_bytes", "allocated (blocks)")):
        for device, nbytes in (meta.get(key) or {}).items():
            rows.append((f"{label} {device}", format_bytes(nbytes)))
    for device, nbytes in (meta.get("unaccounted_bytes") or {}).items():
        rows.append((f"unaccounted {device}", f"{format_bytes(nbytes)} (trace and segments disagree)"))
    print(f"memkit inspect: {args.snapshot}\n")
    print(_rows(rows))
    if not top:
        print("\nmemory never rose above the baseline: no allocations at a peak")
        return 0
    print(f"\ntop {len(top)} allocations live at the peak (op, then the innermost Python frame):")
    table = []
    for a in top:
        frame = a["frame"].splitlines()[-1] if a["frame"] else ""
        path, _, func = frame.partition(" ")
        frame = f"{Path(path).name} {func}".strip()
        where = "  at ".join(w for w in (a["op"], frame) if w) or "?"
        table.append((format_bytes(a["bytes"]), a["category"], a["phase"], where))
    widths = [max(len(r[i]) for r in table) for i in range(3)]
    for size, category, phase, where in table:
        print(f"  {size:>{widths[0]}}  {category:<{widths[1]}}  {phase:<{widths[2]}}  {where}")
    return 0


# ---- report -------------------------------------------------------------------------------------------------
_CSS = """
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 1300px; color: #222; }
table { border-collapse: collapse; font-size: 0.9em; }
th, td { border: 1px solid #ccc; padding: 4px 8px; text-align: right; }
th { background: #f4f4f4; }
.machine td, .machine th { text-align: left; }
p.note { color: #555; max-width: 60em; }
"""


def _report(args: argparse.Namespace) -> int:
    from tqdm.auto import tqdm

    from .plots import comparison_figure, timeline_figure

    _check_preset(args.preset)
    if args.repeats < 0:
        raise CLIError(f"--repeats must be >= 0, got {args.repeats}")
    _check_writable(args.out)
    preset, size = args.preset, args.size

    def model_fn() -> torch.nn.Module:
        return memkit.load_model(preset, size)

    variants = {name: make() for name, make in REPORT_VARIANTS.items()}
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
        "Every variant ran on the same weights and inputs; memory is the exact tracked peak of one step, time "
        f"the median of {args.repeats} untracked step(s) after a warm-up. A variant passes when its output and "
        f"gradients match the baseline within a relative {comparison.tolerance:g}.</p>",
        "<h2>Comparison</h2>",
        table,
    ]
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
class _Formatter(argparse.RawDescriptionHelpFormatter):
    """Keeps the examples as written and shows a default only where it says something."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if action.default not in (None, False, argparse.SUPPRESS) and action.const is None and "default" not in text:
            text += " (default: %(default)s)"
        return text


def _wrap(text: str) -> str:
    width = min(100, shutil.get_terminal_size().columns - 2)
    return textwrap.fill(text, width)


def _presets_epilog() -> str:
    return "presets:\n" + "\n".join(f"  {k:<10} {p.description}" for k, p in memkit.PRESETS.items())


def build_parser() -> argparse.ArgumentParser:
    """The ``memkit`` argument parser (subcommands ``estimate``, ``inspect``, ``report``)."""
    parser = argparse.ArgumentParser(
        prog="memkit",
        description="Measure and cut the memory of diffusion transformers.",
        epilog="examples:\n  memkit estimate flux --checkpointing all\n  memkit inspect snapshot.pickle\n"
        "  memkit report pixart --out report.html\n\nRun 'memkit COMMAND --help' for each command's options.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"memkit {memkit.__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    p = sub.add_parser(
        "estimate",
        help="estimate the peak memory of one step on fake tensors (no memory, no GPU needed)",
        description=_wrap(
            "Estimate the memory of one training or inference step of a preset, at full size by default, without "
            "allocating it: the model runs on fake tensors while memkit's tracker adds up every storage. Full Flux "
            "(11.9B parameters) takes tens of seconds and a few hundred MiB of RAM, on any machine. With --device "
            "cuda (the default) sizes are rounded like the CUDA caching allocator, so the peak compares with "
            "torch.cuda.max_memory_allocated(). Prints GiB (--unit) and seconds; --json prints bytes."
        ),
        epilog="examples:\n"
        "  memkit estimate flux                          # full Flux, bf16 AdamW training step, GiB\n"
        "  memkit estimate flux --checkpointing all      # the same with gradient checkpointing\n"
        "  memkit estimate wan --inference --frames 81 --height 720 --width 1280\n"
        "  memkit estimate sd3 --batch-size 4 --json     # machine-readable, bytes\n\n" + _presets_epilog(),
        formatter_class=_Formatter,
    )
    p.add_argument("preset", metavar="PRESET", help="model preset (see the list below)")
    p.add_argument("--size", choices=("full", "small", "tiny"), default="full", help="model size")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument(
        "--training",
        dest="mode",
        action="store_const",
        const="training",
        help="forward, backward, optimizer step (the default)",
    )
    mode.add_argument(
        "--inference", dest="mode", action="store_const", const="inference", help="forward only, under no_grad"
    )
    p.set_defaults(mode="training")
    p.add_argument("--dtype", choices=tuple(_DTYPES), default="bf16", help="parameter and input dtype")
    p.add_argument(
        "--optimizer",
        choices=("adamw", "adam", "sgd", "none"),
        default=None,
        help="optimizer of the training step (default: adamw in training; none: gradients only)",
    )
    p.add_argument(
        "--steps",
        type=int,
        default=1,
        metavar="N",
        help="run N steps and measure the last (state living across steps counts)",
    )
    p.add_argument("--batch-size", type=int, default=1, metavar="N", help="samples per step")
    for key, unit in _SIZE_FLAGS.items():
        p.add_argument(
            "--" + key.replace("_", "-"),
            dest=key,
            type=int,
            metavar="N",
            default=None,
            help=f"input size in {unit} (default: the preset's, see memkit.PRESETS)",
        )
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="the device to plan for")
    group = p.add_argument_group("optimizations (several compose, applied in this order)")
    for spec in OPTIMIZATION_FLAGS:
        group.add_argument(spec.flag, dest=spec.dest, help=spec.help, default=None, **spec.argument)
    p.add_argument("--unit", choices=tuple(UNITS), default="GiB", help="unit of the printed table")
    p.add_argument("--html", metavar="FILE", help="write the memory timeline as an interactive HTML figure")
    p.add_argument("--png", metavar="FILE", help="write the memory timeline as a PNG (needs kaleido and Chromium)")
    p.add_argument("--json", action="store_true", help="print the result as JSON (bytes, seconds) instead")
    p.set_defaults(run=_estimate)

    p = sub.add_parser(
        "inspect",
        help="summarize a CUDA memory snapshot (.pickle) and its largest allocations at the peak",
        description=_wrap(
            "Read a CUDA allocator snapshot (torch.cuda.memory._dump_snapshot(), or one written by "
            "memkit.memory.snapshot.write_snapshot) safely, without running any code it may contain, and print its "
            "events, devices, baseline, peak (bytes), the time of the peak (seconds), the peak by category, the "
            "allocator's reserved bytes, and the N largest allocations live at the peak."
        ),
        epilog="examples:\n  memkit inspect snapshot.pickle\n  memkit inspect snapshot.pickle --top 20 --html t.html",
        formatter_class=_Formatter,
    )
    p.add_argument("snapshot", metavar="SNAPSHOT.pickle", help="snapshot file")
    p.add_argument("--top", type=int, default=10, metavar="N", help="how many allocations at the peak to list")
    p.add_argument("--html", metavar="FILE", help="write the memory timeline as an interactive HTML figure")
    p.add_argument("--json", action="store_true", help="print the summary as JSON (bytes, seconds) instead")
    p.set_defaults(run=_inspect)

    p = sub.add_parser(
        "report",
        help="compare the optimizations on a real small model and write one self-contained HTML report",
        description=_wrap(
            "Build a preset at a tiny or small size with random weights, run the baseline and each optimization "
            f"({', '.join(REPORT_VARIANTS)}) on the same weights and inputs, tracked exactly, and write one HTML file "
            "(plotly.js inlined, works offline): the comparison table (peak by category in MiB or GiB, step "
            "seconds, output and gradient differences, pass/fail), the comparison figure and the baseline's "
            "memory timeline. tiny takes seconds; small takes minutes on a laptop CPU."
        ),
        epilog="examples:\n  memkit report pixart\n  memkit report flux --size small --out flux.html\n\n"
        + _presets_epilog(),
        formatter_class=_Formatter,
    )
    p.add_argument("preset", metavar="PRESET", help="model preset (see the list below)")
    p.add_argument("--size", choices=("tiny", "small"), default="tiny", help="model size (real memory is used)")
    p.add_argument("--out", default="report.html", metavar="FILE", help="HTML file to write")
    p.add_argument("--mode", choices=("training", "inference"), default="training", help="step to measure")
    p.add_argument("--repeats", type=int, default=3, metavar="N", help="timed steps per variant (0: skip timing)")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.set_defaults(run=_report)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line with ``argv`` (default ``sys.argv[1:]``); returns the exit status.

    Example:
        >>> from memkit.cli import main
        >>> main(["estimate", "flux", "--size", "tiny", "--json"])
        0
    """
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # --help, --version, or argparse's own usage error (already printed)
        return e.code if isinstance(e.code, int) else 2
    try:
        return args.run(args)
    except CLIError as e:
        print(f"memkit {args.command}: error: {e}", file=sys.stderr)
        return e.code
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
