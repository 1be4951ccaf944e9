"""``memkit inspect``."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ..units import format_bytes
from ._common import CLIError, check_writable, rows_text, write_figure


def run(args: argparse.Namespace) -> int:
    """``memkit inspect``: summary, peak and top allocations of a snapshot."""
    from ..memory.snapshot import SnapshotError, read_snapshot

    if args.top < 1:
        raise CLIError(f"--top must be >= 1, got {args.top}")
    check_writable(args.html)
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
        from ..plots import timeline_figure

        fig = timeline_figure(timeline, title=f"memkit inspect: {Path(args.snapshot).name}")
        write_figure(fig, args.html)
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
    print(rows_text(rows))
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
