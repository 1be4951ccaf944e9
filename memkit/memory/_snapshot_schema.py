"""What memkit's snapshot reader (``snapshot.py``) and writer (``snapshot_write.py``) must agree on: torch's
trace actions, memkit's header, the marker frame that carries category, phase and op, and the frame text.

The marker is a first frame ``{"filename": "memkit", "line": 0, "name": "category=activation phase=forward
op=aten.mm.default"}``; the frame text is the tracker's (outermost first, one ``file:line name`` a line), while
torch lists frames innermost first.
"""

from __future__ import annotations

import gc
import re
from collections.abc import Iterator, Mapping
from contextlib import contextmanager

from .events import CATEGORIES, CATEGORY_CODE, PHASE_CODE, PHASES

MARKER_FILENAME = "memkit"
HEADER_KEY, HEADER_VERSION = "memkit", 1  # data["memkit"] = {"version": 1, "devices": ..., "meta": ...}
ALLOC_ACTION, FREE_ACTIONS = "alloc", ("free_requested", "free_completed")
_FRAME_LINE = re.compile(r"^(.*):(\d+) (.*)$")


def marker_frame(category: int, phase: int, op: str | None) -> dict:
    """The frame that carries an entry's category and phase codes and op name."""
    name = f"category={CATEGORIES[category]} phase={PHASES[phase]}"
    return {"filename": MARKER_FILENAME, "line": 0, "name": name if op is None else f"{name} op={op}"}


def is_marker(frame: Mapping) -> bool:
    return frame.get("filename") == MARKER_FILENAME


def parse_marker(frame: Mapping) -> tuple[int, int, str | None]:
    """Category code, phase code (-1 when absent or unknown) and op name (None) of a marker frame."""
    fields = dict(p.split("=", 1) for p in str(frame.get("name", "")).split() if "=" in p)
    category = CATEGORY_CODE.get(fields.get("category", ""), -1)
    return category, PHASE_CODE.get(fields.get("phase", ""), -1), fields.get("op")


def frame_line(frame: Mapping) -> str:
    """One torch frame as a line of frame text (``file:line name``; just the name when there is no file)."""
    filename, name = frame.get("filename", ""), frame.get("name", "")
    return str(name) if filename in ("", "none") else f"{filename}:{frame.get('line', 0)} {name}"


def stack_of(text: str | None) -> list[dict]:
    """Frame text (outermost first) as torch frames (innermost first); the inverse of :func:`frame_line`."""
    frames = []
    for line in reversed(text.split("\n") if text else []):
        m = _FRAME_LINE.match(line)
        frames.append(
            {"filename": m[1], "line": int(m[2]), "name": m[3]} if m else {"filename": "none", "line": 0, "name": line}
        )
    return frames


@contextmanager
def gc_paused() -> Iterator[None]:
    """Pause the cyclic garbage collector: building 10^6 dicts triggers full collections that walk every object
    already built, which makes pickling and unpickling a snapshot 3x slower."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
