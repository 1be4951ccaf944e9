"""``memkit inspect``: needs no torch (a snapshot is read with numpy alone), so it starts in a fraction of a second."""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any

from ..units import format_bytes
from ._common import CLIError, check_writable, rows_text, write_figure

_ARGS = re.compile(r"\(.*\)( const)?$")  # a C++ frame's argument list, too long to show
_FRAME = re.compile(r"^(.*?):(\d+) (.*)$")  # a frame text line: file:line name (the file may hold spaces)
_PY = (".py", ".pyw", ".pyx", ".pyi")
_MAX_OOMS = 5  # out-of-memory errors listed in the text; --json has them all


def run(args: argparse.Namespace) -> int:
    """``memkit inspect``: summary, peaks (per device), segments and top allocations of a snapshot."""
    from ..memory.snapshot import read_snapshot

    if args.replay:
        return _replay(args)
    if args.alloc_conf is not None:
        raise CLIError("--alloc-conf is for --replay")
    if args.top < 1:
        raise CLIError(f"--top must be >= 1, got {args.top}")
    check_writable(args.html)
    timeline = _opened(read_snapshot, args.snapshot)
    devices = timeline.devices
    several = len(devices) > 1
    parts = {d: timeline.on_device(d) for d in devices} if several else {}
    if args.html:
        _write_html(timeline, args)
    if args.json:
        print(json.dumps(_json(timeline, parts, args.top), indent=2))
        return 0
    print(f"memkit inspect: {args.snapshot}\n")
    print(rows_text(_rows(timeline, parts)))
    segments = timeline.meta.get("segments") or {}
    if segments:
        print("\nallocator segments when the snapshot was taken:")
        print(rows_text([row for d, info in segments.items() for row in _segment_rows(d, info, several)]))
    if len(timeline) == 0:
        print("\n" + _no_events(timeline))
        return 0
    for title, tl in [(None, timeline)] if not several else [(d, parts[d]) for d in devices]:
        top = tl.top_allocations(args.top) if tl.peak_index >= 0 else []
        where = f" on {title}" if title else ""
        if not top:
            print(f"\nmemory{where} never rose above its baseline: no allocations at a peak")
            continue
        at = _at(tl, timeline)
        print(f"\ntop {len(top)} allocations live at the peak{where} ({at}; op, then the innermost frame):")
        _print_table(top, with_device=several)
        if timeline.meta.get("source") == "snapshot" and tl.baseline_bytes:  # the trace has no entry for them
            before = format_bytes(tl.baseline_bytes)
            print(f"  not listed: blocks allocated before the trace began ({before} at its start)")
    return 0


_RECORD = "torch.cuda.memory._record_memory_history() before torch.cuda.memory._dump_snapshot()"


def _opened(read, path: str):
    """``read(path)`` (a snapshot reader), its failures as one-line CLI errors."""
    from ..memory.snapshot import SnapshotError

    try:
        return read(path)
    except FileNotFoundError:
        raise CLIError(f"no such file: {path}") from None
    except (SnapshotError, IsADirectoryError, PermissionError) as e:
        raise CLIError(str(e)) from None


def _at(tl, timeline) -> str:
    """When ``tl`` (the timeline or one device's part) peaked, in the trace's unit. Memory that never rose above
    its baseline peaked at no event, so no time or event index is given for it."""
    if tl.peak_index < 0:
        what = "memory never rose above it" if len(tl) else "no allocation or free on this device"
        return f"before the trace (its baseline: {what})"
    t = tl.peak_time
    return f"event {t:.0f}" if timeline.meta.get("time_unit") == "event" else f"{t:.4g} s"


def _no_events(timeline) -> str:
    """Why a snapshot has no events: no trace at all, or a trace of markers and segment actions alone."""
    entries = sum((timeline.meta.get("trace_entries") or {}).values())
    if entries:
        other = f"{entries:,} other entr{'y' if entries == 1 else 'ies'}"
        return f"no allocation or free in the trace: it holds {other} (markers, segment actions, out-of-memory errors)"
    if not timeline.meta.get("segments"):
        return f"this file holds neither a trace nor segments: nothing was recorded (record with {_RECORD})"
    return f"no trace: this file holds the allocator's segments only (record one with {_RECORD})"


def _rows(timeline, parts: dict) -> list[tuple[str, str]]:
    meta = timeline.meta
    events = meta.get("time_unit") == "event"
    snapshot = meta.get("source") == "snapshot"
    sum_note = f" (the {len(parts)} devices summed at one moment)" if parts else ""
    if parts and events:  # without times the traces are laid end to end: their sum is no moment's
        sum_note = f" (the {len(parts)} devices' untimed traces end to end: see each device)"
    rows = [
        ("events", f"{len(timeline):,}" + ("  (ordered by index: the trace has no times)" if events else "")),
        ("devices", ", ".join(timeline.devices) or "none"),
    ]
    if len(timeline) == 0:  # no trace: what was live when the snapshot was taken, and nothing about a peak
        rows.append(("live when taken", f"{format_bytes(timeline.baseline_bytes)} ({timeline.baseline_bytes:,} B)"))
        rows += [(f"  live {d}", format_bytes(tl.baseline_bytes)) for d, tl in parts.items()]
    else:
        rows += [
            (
                "baseline" + (" (live before the trace)" if snapshot else ""),
                f"{format_bytes(timeline.baseline_bytes)} ({timeline.baseline_bytes:,} B)",
            ),
            ("peak" + sum_note, f"{format_bytes(timeline.peak_bytes)} ({timeline.peak_bytes:,} B)"),
            (
                "peak at",
                _at(timeline, timeline) + (f", phase {timeline.peak_phase}" if timeline.peak_index >= 0 else ""),
            ),
        ]
        rows += [(f"  {c}", format_bytes(v)) for c, v in timeline.peak_by_category().items() if v]
        for device, tl in parts.items():
            at = _at(tl, timeline)
            at = f"at {at}" if tl.peak_index >= 0 else at
            rows.append((f"peak {device}", f"{format_bytes(tl.peak_bytes)} ({tl.peak_bytes:,} B) {at}"))
            rows.append((f"  baseline {device}", format_bytes(tl.baseline_bytes)))
    for key, label in (("reserved_bytes", "reserved"), ("allocated_bytes", "allocated (blocks)")):
        for device, nbytes in (meta.get(key) or {}).items():
            rows.append((f"{label} {device}", format_bytes(nbytes)))
    ooms = meta.get("out_of_memory") or []
    for oom in ooms[:_MAX_OOMS]:
        free = oom["device_free_bytes"]
        text = f"asked for {_bytes_or_unknown(oom['requested_bytes'])} with {_bytes_or_unknown(free)} free in CUDA"
        if oom["time"] is not None:
            text += f", at {oom['time']:.4g} s"
        rows.append((f"out of memory {oom['device']}", text))
    if len(ooms) > _MAX_OOMS:
        rows.append(("out of memory", f"... and {len(ooms) - _MAX_OOMS} more (--json lists them all)"))
    for device, nbytes in (meta.get("unaccounted_bytes") or {}).items():
        rows.append((f"unaccounted {device}", f"{format_bytes(nbytes)} (trace and segments disagree)"))
    if snapshot and timeline.peak_by_category().get("unknown"):
        rows.append(("categories", "unknown: a CUDA snapshot records none, and memkit does not guess them"))
    return rows


def _bytes_or_unknown(nbytes: int | None) -> str:
    return "? bytes" if nbytes is None else format_bytes(nbytes)


def _segment_rows(device: str, info: dict[str, Any], several: bool) -> list[tuple[str, str]]:
    blocks = info["blocks"]

    def part(state: str) -> str:
        b = blocks.get(state) or {"count": 0, "bytes": 0}
        return f"{format_bytes(b['bytes'])} in {b['count']:,} block(s)"

    expandable = f", {info['expandable_segments']} expandable" if info["expandable_segments"] else ""
    pending = {"count": 0, "bytes": 0}
    for state in ("active_pending_free", "active_awaiting_free"):
        for k in pending:
            pending[k] += (blocks.get(state) or {}).get(k, 0)
    rows = [
        (device, f"{info['segments']:,} segment(s){expandable}, {format_bytes(info['reserved_bytes'])} reserved"),
        ("  allocated", part("active_allocated")),
        ("  freed, awaiting streams", f"{format_bytes(pending['bytes'])} in {pending['count']:,} block(s)"),
        ("  cached, free", part("inactive") + f"; largest {format_bytes(info['largest_inactive_block'])}"),
    ]
    if info["blocks_by_size"]:
        by_size = sorted(info["blocks_by_size"].items(), key=lambda kv: -sum(kv[1].values()))[:4]
        text = ", ".join(f"{bucket}: {sum(states.values()):,}" for bucket, states in by_size)
        rows.append(("  most blocks", text))
    return rows


def _site(frame: str | None) -> str:
    """The innermost line of a frame text, short: ``file.py:line name``, or a C++ function without its arguments
    (after its file's name when there is one)."""
    if not frame:
        return ""
    line = frame.splitlines()[-1]
    m = _FRAME.match(line)
    if not m:  # a name-only line, or no site at all
        return line
    path, number, func = m.groups()
    name = re.split(r"[/\\]", path)[-1]
    if name.endswith(_PY) or path.startswith("<"):
        return f"{name}:{number} {func}"
    func = _ARGS.sub("()", func)  # a native frame: its arguments would fill the line
    return func if path == "??" else f"{name}{'' if number == '0' else ':' + number} {func}"


def _print_table(top: list[dict], *, with_device: bool) -> None:
    rows = []
    for a in top:
        where = "  at ".join(w for w in (a["op"], _site(a["frame"])) if w) or "?"
        rows.append([a["device"]] * with_device + [format_bytes(a["bytes"]), a["category"], a["phase"], where])
    size = 1 if with_device else 0  # the one right-aligned column
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    for r in rows:
        cells = [f"{c:>{w}}" if i == size else f"{c:<{w}}" for i, (c, w) in enumerate(zip(r[:-1], widths, strict=True))]
        print("  " + "  ".join([*cells, r[-1]]))


def _json(timeline, parts: dict, n: int) -> dict[str, Any]:
    meta = timeline.meta
    summary = timeline.summary()
    unit = "event" if meta.get("time_unit") == "event" else "s"
    top = timeline.top_allocations(n) if timeline.peak_index >= 0 else []
    # peak_time is 0.0 when memory never rose; peak_index -1 says so
    summary.update(devices=timeline.devices, time_unit=unit, peak_index=timeline.peak_index, top=top)
    if parts:
        summary["peak_bytes_sums_devices"] = True
        summary["by_device"] = {
            d: {
                "baseline_bytes": tl.baseline_bytes,
                "peak_bytes": tl.peak_bytes,
                "peak_time": tl.peak_time,
                "peak_index": tl.peak_index,
                "peak_by_category": tl.peak_by_category(),
                "top": tl.top_allocations(n) if tl.peak_index >= 0 else [],
            }
            for d, tl in parts.items()
        }
    for key in ("reserved_bytes", "allocated_bytes", "unaccounted_bytes", "segments", "trace_entries", "out_of_memory"):
        if key in meta:
            summary[key] = meta[key]
    return summary


def _replay(args: argparse.Namespace) -> int:
    """``--replay``: per device, each segment the real allocator made beside the model's; 0 when all alike."""
    from ..memory.snapshot import load_snapshot
    from ..memory.trace_replay import recorded_alloc_conf, replay_trace

    if args.html:
        raise CLIError("--html draws the timeline: it does not go with --replay")
    data = _opened(load_snapshot, args.snapshot)
    try:
        replays = replay_trace(data, args.alloc_conf)
    except ValueError as e:  # no trace, or a conf the model refuses
        raise CLIError(str(e)) from None
    same = all(r.same for r in replays.values())
    if args.json:
        devices = {str(d): _replay_json(r) for d, r in replays.items()}
        print(json.dumps({"snapshot": str(args.snapshot), "same": same, "devices": devices}, indent=2))
        return 0 if same else 1
    conf = next(iter(replays.values())).alloc_conf
    whence = ", from --alloc-conf" if args.alloc_conf is not None else ", recorded" if recorded_alloc_conf(data) else ""
    print(f"memkit inspect --replay: {args.snapshot}")
    print(f"  alloc conf: {repr(conf) if conf else 'none (torch defaults)'}{whence}")
    for d, r in replays.items():
        start = {
            "empty": "starts from an empty allocator",
            "reconstructed": f"starts with {r.older_segments} older segment(s), rebuilt from the snapshot first",
            "not replayed": "starts from a state that cannot be rebuilt",
        }
        print(f"\ndevice {d}: the trace {start[r.start]}")
        if r.reason:
            print(f"  not replayed: {r.reason}")
        elif r.events:
            rows = [(str(e.index), e.action or e.model_action, _size(e.nbytes), _model(e), _yes(e)) for e in r.events]
            _print_columns(("event", "action", "real", "model", "same?"), rows, right=(0, 2, 3))
        print(_replay_summary(d, r))
    return 0 if same else 1


def _size(nbytes: int | None) -> str:
    return "-" if nbytes is None else format_bytes(nbytes)


def _model(e) -> str:
    """The model's segment; its action too where it is not the real one (a plain segment for a mapped page)."""
    kind = e.action is not None and e.model_action is not None and e.model_action != e.action
    return _size(e.model_bytes) + (f" ({e.model_action})" if kind else "")


def _yes(e) -> str:
    if e.same:
        return "yes"
    return "NO (model only)" if e.action is None else "NO (none)" if e.model_bytes is None else "NO"


def _replay_summary(device: int, r) -> str:
    text = f"device {device}: {r.matched} of {r.total} segments the same"
    extra = sum(e.action is None for e in r.events)
    if extra:
        text += f", {extra} more made by the model alone"
    return text + ("" if r.reason is None else " (not replayed)")


def _print_columns(header: tuple[str, ...], rows: list[tuple[str, ...]], right: tuple[int, ...]) -> None:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    for r in [header, *rows]:
        cells = [f"{c:>{w}}" if i in right else f"{c:<{w}}" for i, (c, w) in enumerate(zip(r, widths, strict=True))]
        print("  " + "  ".join(cells).rstrip())


def _replay_json(r) -> dict[str, Any]:
    return {
        "start": r.start,
        "older_segments": r.older_segments,
        "alloc_conf": r.alloc_conf,
        "reason": r.reason,
        "matched": r.matched,
        "total": r.total,
        "same": r.same,
        "events": [
            {
                "index": e.index,
                "action": e.action,
                "bytes": e.nbytes,
                "stream": e.stream,
                "model_action": e.model_action,
                "model_bytes": e.model_bytes,
                "same": e.same,
            }
            for e in r.events
        ],
    }


def _write_html(timeline, args: argparse.Namespace) -> None:
    from ..plots import segments_figure, timeline_figure

    name = Path(args.snapshot).name
    if len(timeline) == 0 and timeline.meta.get("segments"):
        fig = segments_figure(timeline)
        fig.update_layout(title=f"memkit inspect: {name} (no trace): {fig.layout.title.text}")
    else:
        fig = timeline_figure(timeline, title=f"memkit inspect: {name}")
    write_figure(fig, args.html)
    print(f"wrote {args.html}", file=sys.stderr if args.json else sys.stdout)
