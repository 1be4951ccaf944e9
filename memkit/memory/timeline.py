"""`Timeline`: the events of one tracked window as numpy columns, and the questions asked of them."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from ..units import format_bytes
from ._timeline_reserved import _Reserved
from .events import ACTIONS, ALLOC, CATEGORIES, COLUMNS, PHASES


class Timeline(_Reserved):
    """Memory events of one tracked window (allocations and frees of storages), as numpy columns.

    A Timeline comes from :func:`memkit.track`, :func:`memkit.estimate` or
    :meth:`Timeline.from_snapshot`. While its ``track()`` block runs it follows the tracker live; after the
    block it is fixed.

    ``baseline_bytes`` is what was live when tracking began and memkit knows about: the model's parameters,
    buffers and gradients, optimizer state, EMA shadows and inputs. ``peak_bytes`` is the baseline plus the
    highest point the events reach, so ``peak_bytes - baseline_bytes`` is what the window added at its worst.

    On several devices ``peak_bytes`` is the devices' sum at one moment; :meth:`peak_by_device` gives each
    device's own peak (the figure an out-of-memory error is about) and :meth:`on_device` its events alone.
    That needs the baseline's split across devices (``baseline_by_device``: snapshots know it, and a
    one-device timeline trivially does).

    Example:
        >>> with memkit.track() as tl:
        ...     memkit.train_step(model, inputs)
        >>> tl.peak_bytes, tl.peak_by_category()["activation"]
    """

    def __init__(
        self,
        columns: Mapping[str, np.ndarray] | None = None,
        *,
        baseline_by_category: Mapping[str, int] | None = None,
        devices: list[str] | None = None,
        ops: list[str] | None = None,
        frames: list[str] | None = None,
        meta: Mapping[str, Any] | None = None,
        source: Callable[[Any], tuple[Any, dict, dict] | None] | None = None,
        baseline_by_device: Mapping[str, Mapping[str, int]] | None = None,
        reserved: tuple[np.ndarray, int] | None = None,
    ):
        self._source = source
        self._reserved: tuple[np.ndarray, int] | None = None
        self._version: Any = None
        self._columns: dict[str, np.ndarray] = {}
        self._baseline: dict[str, int] = {}
        self.devices: list[str] = []
        self.ops: list[str] = []
        self.frames: list[str] = []
        self.meta: dict[str, Any] = dict(meta or {})
        self._cache: dict[str, Any] = {}
        self._baseline_dev: dict[str, dict[str, int]] | None = None
        self.baseline_blocks: list[tuple[int, int, int]] | None = None
        """The baseline's storages as ``(storage key, bytes, device code)`` in allocation order, where the window's
        source knows them (an estimate: what the allocator replay lays out first); None otherwise."""
        self.input_keys: frozenset[int] = frozenset()
        """Storage keys of the baseline's inputs among ``baseline_blocks``."""
        self.op_counts: Any = None
        """The steady step's ops (:class:`memkit.steptime.OpCounts`) where the estimate counted them
        (``memkit.estimate(..., count_ops=True)``); None otherwise."""
        if baseline_by_device is not None and baseline_by_category is None:
            baseline_by_category = {
                c: sum(int(split.get(c, 0)) for split in baseline_by_device.values()) for c in CATEGORIES
            }
        if source is None:
            self._set(columns or {}, baseline_by_category or {}, devices or [], ops or [], frames or [])
        if baseline_by_device is not None:
            self._baseline_dev = self._check_split(baseline_by_device)
        if reserved is not None:
            self.set_reserved(*reserved)

    def _check_split(self, split: Mapping[str, Mapping[str, int]]) -> dict[str, dict[str, int]]:
        stray = set(split) - set(self.devices)
        if stray:
            raise ValueError(f"baseline_by_device names devices {sorted(stray)} that are not in devices {self.devices}")
        out = {}
        for device in self.devices:
            by_cat = split.get(device, {})
            unknown = set(by_cat) - set(CATEGORIES)
            if unknown:
                raise ValueError(f"baseline_by_device[{device!r}] has unknown categories {sorted(unknown)}")
            out[device] = {c: int(by_cat.get(c, 0)) for c in CATEGORIES}
        for c in CATEGORIES:
            total = sum(by_cat[c] for by_cat in out.values())
            if total != self._baseline[c]:
                raise ValueError(
                    f"baseline_by_device sums to {total} bytes of {c!r}, "
                    f"but baseline_by_category says {self._baseline[c]}"
                )
        return out

    def _set(self, columns, baseline, devices, ops, frames) -> None:
        n = len(next(iter(columns.values()))) if columns else 0
        cols = {}
        for name, dtype in COLUMNS:
            if not columns:
                col = np.zeros(0, dtype=dtype)
            elif name in columns:
                col = np.asarray(columns[name], dtype=dtype)
            elif name in ("op", "frame"):
                col = np.full(n, -1, dtype=dtype)
            else:
                raise ValueError(f"columns is missing {name!r}; a Timeline needs {[c for c, _ in COLUMNS]}")
            if len(col) != n:
                raise ValueError(f"column {name!r} has {len(col)} rows, expected {n}")
            cols[name] = col
        for name, names in (("action", ACTIONS), ("category", CATEGORIES), ("phase", PHASES)):
            col = cols[name]
            if len(col) and (col.min() < 0 or col.max() >= len(names)):
                bad = int(col[(col < 0) | (col >= len(names))][0])
                raise ValueError(f"column {name!r} holds code {bad}; codes must be 0..{len(names) - 1} ({names})")
        unknown = set(baseline) - set(CATEGORIES)
        if unknown:
            raise ValueError(f"baseline_by_category has unknown categories {sorted(unknown)}; allowed: {CATEGORIES}")
        self._columns = cols
        self._baseline = {c: int(baseline.get(c, 0)) for c in CATEGORIES}
        self.devices, self.ops, self.frames = list(devices), list(ops), list(frames)
        self._cache = {}

    def _sync(self) -> None:
        if self._source is not None:
            update = self._source(self._version)
            if update is not None:  # the tracker recorded something since the last look
                self._version, columns, extra = update
                self._set(columns, extra["baseline"], extra["devices"], extra["ops"], extra["frames"])

    def _freeze(self) -> None:
        """Take the tracker's final state and stop following it."""
        self._sync()
        self._source = None

    # ---- raw data -------------------------------------------------------------------------------------------
    def column(self, name: str) -> np.ndarray:
        """One event column by name (see ``memkit.memory.events.COLUMNS``)."""
        self._sync()
        if name not in self._columns:
            raise KeyError(f"no column {name!r}; columns: {list(self._columns)}")
        return self._columns[name]

    def __len__(self) -> int:
        return len(self.column("bytes"))

    @property
    def time(self) -> np.ndarray:
        """Seconds since tracking began, one per event."""
        return self.column("time")

    @property
    def signed_bytes(self) -> np.ndarray:
        """Bytes per event: positive for an allocation, negative for a free."""
        b = self.column("bytes")
        if "signed" not in self._cache:
            self._cache["signed"] = np.where(self._columns["action"] == ALLOC, b, -b)
        return self._cache["signed"]

    # ---- totals -------------------------------------------------------------------------------------------
    @property
    def baseline_by_category(self) -> dict[str, int]:
        """Bytes live when tracking began, by category."""
        self._sync()
        return dict(self._baseline)

    @property
    def baseline_bytes(self) -> int:
        """Bytes live when tracking began (the storages memkit knows about)."""
        return sum(self.baseline_by_category.values())

    @property
    def live_bytes(self) -> np.ndarray:
        """Bytes live after each event (int64 series, same length as the events)."""
        self._sync()
        if "live" not in self._cache:
            self._cache["live"] = self.baseline_bytes + np.cumsum(self.signed_bytes, dtype=np.int64)
        return self._cache["live"]

    @property
    def peak_index(self) -> int:
        """Index of the event after which memory was highest (the first such), or -1 if it never rose."""
        live = self.live_bytes
        if "peak_index" not in self._cache:
            empty = len(live) == 0 or live.max() <= self.baseline_bytes
            self._cache["peak_index"] = -1 if empty else int(np.argmax(live))
        return self._cache["peak_index"]

    @property
    def peak_bytes(self) -> int:
        """Highest live bytes over the window, baseline included."""
        i = self.peak_index
        return self.baseline_bytes if i < 0 else int(self.live_bytes[i])

    def peak_between(self, start: int, stop: int | None = None) -> int:
        """Highest live bytes over the events ``start`` to ``stop`` (exclusive; None: the end), counting the bytes
        already live when event ``start`` happens: the peak of one part of the window, e.g. one step of several.

        Example:
            >>> tl.peak_between(0, tl.meta["step_starts"][1])   # the first step's peak
        """
        live = self.live_bytes
        stop = len(live) if stop is None else stop
        if not 0 <= start <= stop <= len(live):
            raise IndexError(f"start and stop must satisfy 0 <= start <= stop <= {len(live)}, got {start}, {stop}")
        before = self.baseline_bytes if start == 0 else int(live[start - 1])
        return max(before, int(live[start:stop].max())) if stop > start else before

    def copy(self) -> Timeline:
        """A fixed copy (the event columns shared, read-only; ``meta`` copied one level deep).

        Example:
            >>> mine = tl.copy(); mine.meta["label"] = "mine"   # tl's meta is unchanged
        """
        self._sync()
        columns = {}
        for name, col in self._columns.items():
            view = col.view()
            view.flags.writeable = False
            columns[name] = view
        meta = {
            k: (dict(v) if isinstance(v, dict) else list(v) if isinstance(v, list) else v) for k, v in self.meta.items()
        }
        return Timeline(
            columns,
            baseline_by_category=self._baseline,
            devices=self.devices,
            ops=self.ops,
            frames=self.frames,
            meta=meta,
            baseline_by_device=self._baseline_dev,
            reserved=self._reserved,
        )._with_blocks(self)

    def _with_blocks(self, other: Timeline) -> Timeline:
        self.baseline_blocks = None if other.baseline_blocks is None else list(other.baseline_blocks)
        self.input_keys = other.input_keys
        self.op_counts = other.op_counts
        return self

    @property
    def peak_time(self) -> float:
        """Seconds since tracking began at the peak (0.0 if memory never rose above the baseline)."""
        i = self.peak_index
        return 0.0 if i < 0 else float(self.time[i])

    @property
    def peak_phase(self) -> str:
        """The phase of the event at the peak ("other" if memory never rose above the baseline)."""
        i = self.peak_index
        return "other" if i < 0 else PHASES[self.column("phase")[i]]

    @property
    def end_bytes(self) -> int:
        """Bytes live at the end of the window."""
        live = self.live_bytes
        return int(live[-1]) if len(live) else self.baseline_bytes

    def live_by_category(self) -> dict[str, np.ndarray]:
        """Bytes live after each event, one int64 series per category (baseline included)."""
        self._sync()
        if "by_cat" not in self._cache:
            signed, cat = self.signed_bytes, self._columns["category"]
            out = {}
            for code, name in enumerate(CATEGORIES):
                mine = np.where(cat == code, signed, 0)
                out[name] = self._baseline[name] + np.cumsum(mine, dtype=np.int64)
            self._cache["by_cat"] = out
        return self._cache["by_cat"]

    def bytes_by_category_at(self, index: int) -> dict[str, int]:
        """Bytes live by category after event ``index`` (-1: at the start)."""
        if index == -1:
            return self.baseline_by_category
        if not 0 <= index < len(self):
            raise IndexError(f"index must be in [-1, {len(self) - 1}], got {index}")
        signed, cat = self.signed_bytes[: index + 1], self._columns["category"][: index + 1]
        sums = np.bincount(cat, weights=signed, minlength=len(CATEGORIES))
        return {name: self._baseline[name] + int(sums[code]) for code, name in enumerate(CATEGORIES)}

    def peak_by_category(self) -> dict[str, int]:
        """Bytes live by category at the peak; the values sum to ``peak_bytes``."""
        index = self.peak_index
        if "peak_by_category" not in self._cache:
            self._cache["peak_by_category"] = self.bytes_by_category_at(index)
        return dict(self._cache["peak_by_category"])

    # ---- devices --------------------------------------------------------------------------------------------
    def _device_split(self) -> dict[str, dict[str, int]] | None:
        self._sync()
        if self._baseline_dev is not None:
            return self._baseline_dev
        if len(self.devices) == 1:
            return {self.devices[0]: dict(self._baseline)}
        if not any(self._baseline.values()):
            return {d: dict.fromkeys(CATEGORIES, 0) for d in self.devices}
        return None

    @property
    def baseline_by_device(self) -> dict[str, int] | None:
        """Bytes live when tracking began, per device (``devices`` order); None when several devices share a
        baseline whose split is unknown (a tracked window on several devices)."""
        split = self._device_split()
        return None if split is None else {d: sum(v.values()) for d, v in split.items()}

    def on_device(self, device: str) -> Timeline:
        """This window's events on ``device`` alone, with that device's baseline: its ``peak_bytes`` is the
        device's own peak. Event indices are the sub-timeline's; times and the op and frame tables are kept.

        Example:
            >>> tl = memkit.Timeline.from_snapshot("two_gpus.pickle")
            >>> tl.on_device("cuda:1").top_allocations(5)
        """
        split = self._device_split()
        if device not in self.devices:
            raise KeyError(f"no device {device!r}; devices: {self.devices}")
        if split is None:
            raise ValueError(
                f"this timeline's baseline ({format_bytes(self.baseline_bytes)}) spans devices {self.devices} and "
                "its split between them is unknown, so one device's memory cannot be told apart "
                "(give Timeline(baseline_by_device=...))"
            )
        cached = self._cache.setdefault("on_device", {})
        if device not in cached:
            mask = self._columns["device"] == self.devices.index(device)
            cols = {name: col[mask] for name, col in self._columns.items()}
            cols["device"] = np.zeros(int(mask.sum()), dtype=cols["device"].dtype)
            meta = {**self.meta, "device": device}
            cached[device] = Timeline(
                cols, baseline_by_category=split[device], devices=[device], ops=self.ops, frames=self.frames, meta=meta
            )
        return cached[device]

    def peak_by_device(self) -> dict[str, int]:
        """Each device's own peak (its baseline included), in ``devices`` order. ``peak_bytes`` is instead the
        highest sum over the devices at one moment, which no single GPU ever held. Raises ValueError when the
        baseline spans devices and its split is unknown (see ``baseline_by_device``)."""
        return {d: self.on_device(d).peak_bytes for d in self.devices}

    def phase_spans(self) -> list[tuple[str, float, float]]:
        """Contiguous runs of one phase as ``(phase, start_time, end_time)``, in order."""
        phase, time = self.column("phase"), self._columns["time"]
        if len(phase) == 0:
            return []
        change = np.flatnonzero(np.diff(phase)) + 1
        starts = np.concatenate([[0], change])
        ends = np.concatenate([change, [len(phase)]])
        spans = []
        for s, e in zip(starts, ends, strict=True):
            t_end = float(time[e]) if e < len(time) else float(time[-1])
            spans.append((PHASES[phase[s]], float(time[s]), t_end))
        return spans

    def top_allocations(self, n: int = 10, *, at: int | None = None) -> list[dict[str, Any]]:
        """The ``n`` largest allocations live at event ``at`` (default: the peak), biggest first."""
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        at = self.peak_index if at is None else at
        if not -1 <= at < len(self):
            raise IndexError(f"at must be in [-1, {len(self) - 1}], got {at}")
        self._sync()
        cols = self._columns
        alive: dict[int, int] = {}
        action, storage = cols["action"].tolist(), cols["storage"].tolist()
        for i in range(at + 1):
            if action[i] == ALLOC:
                alive[storage[i]] = i
            else:
                alive.pop(storage[i], None)
        rows = sorted(alive.values(), key=lambda i: -int(cols["bytes"][i]))[:n]
        return [self._describe(i) for i in rows]

    def _describe(self, i: int) -> dict[str, Any]:
        c = self._columns
        return {
            "index": i,
            "bytes": int(c["bytes"][i]),
            "category": CATEGORIES[c["category"][i]],
            "phase": PHASES[c["phase"][i]],
            "time": float(c["time"][i]),
            "device": self.devices[c["device"][i]] if self.devices else "?",
            "op": self.ops[c["op"][i]] if c["op"][i] >= 0 else None,
            "frame": self.frames[c["frame"][i]] if c["frame"][i] >= 0 else None,
        }

    def to_pandas(self):
        """The events as a pandas DataFrame with readable category, phase, device and op names (and
        ``reserved_bytes`` where the allocator was replayed)."""
        import pandas as pd

        self._sync()
        c = self._columns
        ops = np.array(self.ops + [""], dtype=object)
        reserved = {} if self._reserved is None else {"reserved_bytes": self._reserved[0]}
        return pd.DataFrame(
            {
                "time": c["time"],
                "action": np.array(["alloc", "free"])[c["action"]],
                "bytes": c["bytes"],
                "category": np.array(CATEGORIES)[c["category"]],
                "phase": np.array(PHASES)[c["phase"]],
                "device": np.array(self.devices or ["?"], dtype=object)[np.clip(c["device"], 0, None)],
                "op": ops[c["op"]],
                "live_bytes": self.live_bytes,
                **reserved,
            }
        )

    def summary(self) -> dict[str, Any]:
        """Peak, baseline, end and peak-by-category, as plain numbers; on several devices whose baseline
        split is known, also ``peak_by_device`` (each device's own peak; ``peak_bytes`` is their sum)."""
        out = {
            "events": len(self),
            "baseline_bytes": self.baseline_bytes,
            "peak_bytes": self.peak_bytes,
            "end_bytes": self.end_bytes,
            "peak_time": self.peak_time,
            "peak_phase": self.peak_phase,
            "peak_by_category": self.peak_by_category(),
        }
        if len(self.devices) > 1 and self._device_split() is not None:
            out["peak_by_device"] = self.peak_by_device()
        return out

    @classmethod
    def from_snapshot(cls, source, **kwargs) -> Timeline:
        """Read a CUDA memory snapshot (a ``torch.cuda.memory._dump_snapshot`` pickle path, bytes, file or
        dict) safely: the unpickler refuses every class. Keyword arguments go to
        :func:`memkit.memory.snapshot.read_snapshot`.

        Example:
            >>> tl = memkit.Timeline.from_snapshot("snapshot.pickle")
            >>> tl.peak_bytes, tl.top_allocations(5)
        """
        from .snapshot import read_snapshot

        return read_snapshot(source, **kwargs)

    def to_snapshot(self, path=None) -> dict:
        """Write this timeline as a snapshot pickle (protocol 4) in torch's schema, categories kept, for
        pytorch.org/memory_viz and ``torch.cuda._memory_viz``; returns the dict.

        Example:
            >>> tl.to_snapshot("step.pickle")   # open it at pytorch.org/memory_viz
        """
        from .snapshot_write import write_snapshot

        return write_snapshot(self, path)

    def __repr__(self) -> str:
        label = self.meta.get("label")
        head = f"Timeline({label!r}, " if label else "Timeline("
        return (
            f"{head}events={len(self)}, baseline={format_bytes(self.baseline_bytes)}, "
            f"peak={format_bytes(self.peak_bytes)})"
        )


def peak_step(meta: Mapping[str, Any], *, reserved: bool = False) -> str:
    """Which step an estimate's peak is in, in words, from its ``meta``: with both steps measured, the larger one's
    (``"steady step"``, ``"first step"``, or ``"first = steady step"``), else the one measured (``"first step"``,
    ``"step N"``: the last of ``steps=N``) or ``"inference pass"``. ``reserved``: of the reserved peaks.

    Example:
        >>> peak_step(memkit.estimate("flux").meta)
        'first = steady step'
    """
    measured = meta.get("measured")
    if measured == "first and steady":
        kind = "reserved_" if reserved else ""
        first, steady = meta.get(f"first_step_peak_{kind}bytes"), meta.get(f"steady_peak_{kind}bytes")
        if first is None or steady is None:
            return "first and steady steps"
        return "steady step" if steady > first else "first step" if first > steady else "first = steady step"
    if measured == "first":
        return "first step"
    if measured == "steady":
        return f"step {meta.get('steps')}"
    return "inference pass"
