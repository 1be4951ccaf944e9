"""``python -m bench.mutation [MODULE ...] [--jobs N]``: mutation testing of memkit with mutmut, results in MUTATION.md.

A mutant is memkit with one small change (``<`` for ``<=``, ``+ 1`` for ``- 1``, a string or a constant
altered, a call argument dropped). A test suite that can fail kills it: some test goes red. Each module below
is mutated alone, against only the fast test files that are about it (``MODULES``), so one module takes
seconds to minutes instead of the whole suite per mutant.

How it runs: the module's code and ``tests/`` are copied from the work tree into ``build/mutation/<module>/``
(so nothing in the work tree is ever changed, and people editing it are not disturbed), with a small
``[tool.mutmut]`` config; mutmut (3.x) imports torch and the tests once in a fork server, forks one child per
mutant and runs only the tests that reach the mutated function. A mutant whose tests run longer than
``(clean duration + timeout_constant) x timeout_multiplier`` seconds (defaults 5 s and 3) is stopped and
counted as a timeout. The results of each module replace that module's section of ``bench/MUTATION.md``
(other modules' sections stay), and the copy stays in ``build/mutation/<module>/`` for ``mutmut show NAME``
or ``mutmut browse`` there.

``% killed`` is ``(killed + timeout) / (mutants - equivalent)``: a mutant that makes the tests hang is caught.
An equivalent mutant changes no behaviour anyone can observe (``EQUIVALENT``, one line of reason each); it is
listed, not counted. What mutmut does not mutate: module-level constants (``CATEGORIES``, ``UNITS``), type
hints, docstrings, and decorated functions (``@property``, ``@contextlib.contextmanager``: ``track()``,
``allocator_window()``, ``Timeline.peak_bytes``...), which each module's section lists as "not mutated";
only the bodies of plain functions and methods (and static and class methods) are.

Not in ``MODULES``: ``memkit/memory/__init__.py`` (lazy re-exports, no logic of its own).

CUDA-only code (``memkit/memory/cuda.py``) runs on CPU against a stand-in for ``torch.cuda``'s private
history API (``tests/test_cuda.py`` monkeypatches it), so its branches are mutated and checked here too.

Not part of ``make test`` or CI: a full run takes well over an hour on two cores (``comparison.py`` and
``tracker.py`` run tiny models for every mutant; use ``--max-seconds`` to bound each module).

Example:
    $ python -m bench.mutation                  # every module in MODULES
    $ python -m bench.mutation units events     # two modules
    $ python -m bench.mutation timeline --jobs 1 --max-seconds 600
"""

from __future__ import annotations

import argparse
import ast
import datetime
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from . import log, machine, markdown_table

ROOT = Path(__file__).resolve().parent.parent
RESULTS = Path(__file__).with_name("MUTATION.md")
WORK = ROOT / "build" / "mutation"

MODULES: dict[str, tuple[str, tuple[str, ...]]] = {
    # name: (what is mutated, the fast test files that are about it; a file not there yet is skipped)
    "units": ("memkit/units.py", ("tests/test_units.py",)),
    "events": ("memkit/memory/events.py", ("tests/test_events.py", "tests/test_timeline.py")),
    "timeline": ("memkit/memory/timeline.py", ("tests/test_timeline.py", "tests/test_mutants_memory.py")),
    "cuda": ("memkit/memory/cuda.py", ("tests/test_cuda.py",)),
    "allocator": ("memkit/memory/allocator.py", ("tests/test_allocator.py",)),
    "tracker": ("memkit/memory/tracker.py", ("tests/test_tracker_fast.py",)),
    "roles": (
        "memkit/memory/_roles.py",
        ("tests/test_tracker_fast.py", "tests/test_categories.py", "tests/test_roles.py"),
    ),
    "recording": ("memkit/memory/recording.py", ("tests/test_tracker_fast.py", "tests/test_recording.py")),
    "fake_dispatch": ("memkit/memory/_fake_dispatch.py", ("tests/test_fake_dispatch.py",)),
    "memo": ("memkit/_memo.py", ("tests/test_memo_probe.py", "tests/test_memo.py")),
    # tests/test_memo.py reaches the splice only through real presets' estimates (minutes a mutant): the splice is
    # judged by tests/test_splice.py, hand-made probe events whose full-model events are worked out by hand
    "splice": ("memkit/_splice.py", ("tests/test_splice.py",)),
    "workspace": ("memkit/memory/workspace/*", ("tests/test_workspace_fast.py",)),
    "snapshot": (
        "memkit/memory/snapshot.py",
        (
            "tests/test_snapshot.py",
            "tests/test_snapshot_real.py",
            "tests/test_snapshot_frames.py",
            "tests/test_snapshot_write.py",
            "tests/test_mutants_memory.py",
        ),
    ),
    "snapshot_frames": (
        "memkit/memory/_snapshot_frames.py",
        ("tests/test_snapshot_frames.py", "tests/test_snapshot.py", "tests/test_snapshot_real.py"),
    ),
    "snapshot_schema": (
        "memkit/memory/_snapshot_schema.py",
        ("tests/test_snapshot_schema.py", "tests/test_snapshot.py", "tests/test_snapshot_real.py"),
    ),
    "snapshot_write": (
        "memkit/memory/snapshot_write.py",
        (
            "tests/test_snapshot_write.py",
            "tests/test_snapshot.py",
            "tests/test_snapshot_real.py",
            "tests/test_mutants_memory.py",
        ),
    ),
    "rss": ("memkit/memory/rss.py", ("tests/test_rss.py",)),
    # test_fsdp.py runs FSDP2 on a fake process group: seconds per test, so run it with --max-seconds
    "fsdp": ("memkit/memory/fsdp.py", ("tests/test_fsdp.py",)),
    "handle": ("memkit/handle.py", ("tests/test_handle.py", "tests/test_mutants_handle.py")),
    # tests/test_compare.py runs real diffusers presets (minutes per mutant): the fast file is enough here
    "compare": ("memkit/comparison.py", ("tests/test_comparison_fast.py",)),
    # The optimizations one module each, like memory/: the whole package (17 files, ~5,000 mutants) against the
    # tests that reach it would take hours on two cores.
    "optimizations": ("memkit/optimizations/__init__.py", ("tests/test_optimizations.py",)),
    "checkpointing": (
        "memkit/optimizations/checkpointing.py",
        ("tests/test_checkpointing.py", "tests/test_checkpointing_offload.py"),
    ),
    # FFSplit is two files: feedforward.py finds the layers and swaps their forwards, _ff_chunks.py computes the
    # chunks. A target is one file or one glob, so each is its own entry, run against the same test file.
    "feedforward": ("memkit/optimizations/feedforward.py", ("tests/test_feedforward.py",)),
    "ff_chunks": ("memkit/optimizations/_ff_chunks.py", ("tests/test_feedforward.py",)),
    # The EMA is three files: ema.py the optimization and its handle, _ema_state.py the shadows and their buffers,
    # _ema_update.py the update (foreach, chunked, staged through another dtype or the host)
    "ema": ("memkit/optimizations/ema.py", ("tests/test_ema.py",)),
    "ema_state": ("memkit/optimizations/_ema_state.py", ("tests/test_ema.py",)),
    "ema_update": ("memkit/optimizations/_ema_update.py", ("tests/test_ema.py",)),
    "offload": ("memkit/optimizations/offload.py", ("tests/test_offload.py",)),
    "offload_store": ("memkit/optimizations/_offload_store.py", ("tests/test_offload.py",)),
    "lora": ("memkit/optimizations/lora.py", ("tests/test_lora.py",)),
    "quantization": ("memkit/optimizations/quantization.py", ("tests/test_quantization.py",)),
}
"""Module name -> (the file or glob mutmut mutates, the test files run against each mutant)."""

MARKERS: dict[str, str] = {
    # name: a pytest -m expression run against each mutant (its test files hold slow suites: every preset
    # trained, minutes per mutant, where a fast test already runs the same code path)
    "checkpointing": "not slow",
    "feedforward": "not slow",
    "ff_chunks": "not slow",
    # each file's slow cases are full-size models, the README table, the CLI and every preset again (tens of seconds
    # per mutant); `make test-fast` keeps one case per code path, and those run against each mutant
    "lora": "not slow",
    "quantization": "not slow",
    "offload": "not slow",
    "offload_store": "not slow",
}

KEYWORDS: dict[str, str] = {
    # name: a pytest -k expression run against each mutant, where a test file's slow part carries no marker of its own
    # test_fake_dispatch.py's estimates with the cache on and off take ~13 s a mutant (two presets, even in `make
    # test-fast`): the cache's own tests (tests/test_fake_dispatch.py's others) judge it
    "fake_dispatch": "not byte_equal",
    # test_memo.py splices real presets' estimates (seconds each, minutes a mutant): its two tests that run none, and
    # test_memo_probe.py (the probe's functions alone, in a second)
    "memo": "test_memo_probe or block_lists_need_identical_blocks or middle_blocks_differ",
}

EQUIVALENT: dict[tuple[str, str], str] = {
    ("EMA.apply", "lambda: 0,"): "the handle's undo: Handle calls it for its effect and drops what it returns",
    ("EMA.parse", 'key, _, number = rest.rpartition("=")'): "the two differ only where the value holds two '=': "
    "then the number (partition) or the key (rpartition) holds one, and either is refused",
    # (function, the mutated line as mutmut shows it after "+", stripped): why no behaviour can change
    **{
        ("EventLog.columns", f"cols = list(zip(*self.rows, {arg}))"): "differs only for rows of mixed widths, "
        "which the tracker never writes (its rows are fixed 9-tuples); a short row fails either way (IndexError)"
        for arg in ("strict=None", "", "strict=False")
    },
    (
        "record_cuda_history",
        'torch.cuda.memory._record_memory_history(context="all", stacks=stacks, max_entries=max_entries)',
    ): "torch's own default for enabled is 'all'",
    ("Timeline.__init__", 'self._version: Any = ""'): "a source compares versions for equality and never returns "
    "'' or None, so the first look gets everything either way",
    **{
        ("Timeline.__init__", f"self.{name}: {hint} = None"): "set by _set before any read: at once without a "
        "source; with one, every reader calls _sync first and the first look always returns data"
        for name, hint in (("_columns", "dict[str, np.ndarray]"), ("_baseline", "dict[str, int]"))
    },
    ("Timeline.__init__", "self._cache: dict[str, Any] = None"): "set by _set before any read (see _columns)",
    ("Timeline._sync", "update = self._source(None)"): "asking with None always gets a full update: the same "
    "data, only rebuilt at every look",
    **{
        (function, f'if "{key}" not in self._cache:'): "a cache miss every time: the same value, recomputed"
        for function, keys in (
            ("Timeline.live_by_category", ("XXby_catXX", "BY_CAT")),
            ("Timeline.peak_by_category", ("XXpeak_by_categoryXX", "PEAK_BY_CATEGORY")),
        )
        for key in keys
    },
    **{
        ("Timeline.live_by_category", f"out[name] = self._baseline[name] + np.cumsum(mine, {arg})"): "the "
        "summands are already int64 (signed copies of the int64 bytes column), so the sums are int64 either way"
        for arg in ("dtype=None", "")
    },
    **{
        ("Timeline.phase_spans", f"for s, e in zip(starts, ends, {arg}):"): "starts and ends have the same "
        "length by construction"
        for arg in ("strict=None", "", "strict=False")
    },
    **{
        ("Timeline.to_pandas", line): "pandas stores a numpy str array and an object array of str as the same "
        "str column"
        for line in (
            'ops = np.array(self.ops + [""], dtype=None)',
            'ops = np.array(self.ops + [""], )',
            '"device": np.array(self.devices or ["?"], dtype=None)[np.clip(c["device"], 0, None)],',
            '"device": np.array(self.devices or ["?"], )[np.clip(c["device"], 0, None)],',
        )
    },
    **{
        ("parse_marker", f'fields = dict(p.split("=", 1) for p in str(frame.get("name", {d})).split() if "=" in p)'): (
            "a frame without a name has no key=value words either way ('None' and 'XXXX' hold no '=')"
        )
        for d in ("None", "", '"XXXX"')
    },
    **{
        ("parse_marker", line.format(d)): "a missing key looks up a name that is no category or phase either way: -1"
        for d in ("None", "", '"XXXX"')
        for line in (
            'category = CATEGORY_CODE.get(fields.get("category", {}), -1)',
            'return category, PHASE_CODE.get(fields.get("phase", {}), -1), fields.get("op")',
        )
    },
    **{
        ("Timeline.on_device", f"cached = self._cache.setdefault({key}, {{}})"): "the sub-timelines are cached "
        "under another key of the same cache: the same lookups"
        for key in ("None", '"XXon_deviceXX"', '"ON_DEVICE"')
    },
    **{
        ("Timeline.on_device", f'cols["device"] = np.zeros(int(mask.sum()), {arg})'): "Timeline() casts every "
        "column to its schema dtype, so float zeros become int16 zeros"
        for arg in ("dtype=None", "")
    },
    (
        "Timeline.to_pandas",
        '"device": np.array(self.devices or ["?"], dtype=object)[np.clip(c["device"], None, None)],',
    ): "device codes are interner indices, never negative: clipping at 0 changes none",
    # ---- _snapshot_frames.py
    **{
        ("is_python", f'filename = str(frame.get("filename", {d}))'): "a frame without a filename is native "
        "either way: 'None' and 'XXXX' neither end in .py, start with '<' nor equal 'none'"
        for d in ("None", "", '"XXXX"')
    },
    **{
        ("_file_and_name", line.format(d)): "a missing filename or name reads as 'None' or 'XXXX' instead of '': "
        "neither names a phase (no 'torch', 'checkpoint', '/optim/' or 'training_utils.py'; no backward, forward, "
        "step or _foreach_ name; 'None' is not the profiler's 'none')"
        for d in ("None", "", '"XXXX"')
        for line in (
            'filename, name = str(frame.get("filename", {})), str(frame.get("name", ""))',
            'filename, name = str(frame.get("filename", "")), str(frame.get("name", {}))',
        )
    },
    ("phase_of", "return -2"): "its one caller (Frames.decode) and snapshot.py read any negative phase as none",
    # ---- rss.py
    ("rss_bytes", 'with open("/proc/self/statm", ) as f:'): "statm is ASCII digits: int() reads the field from str "
    "as from bytes",
    **{
        (f"Frames.{name}", line): "every caller passes with_text (snapshot.py, and codes() to decode())"
        for name, line in (
            ("codes", "def codes(self, stacks: list, *, with_text: bool = False) -> np.ndarray:"),
            ("decode", "def decode(self, stack, with_text: bool = False) -> tuple[int, int, int, int]:"),
        )
    },
    **{
        ("Frames.codes", f"return np.full({shape}, {value}, {dtype})"): "an empty list of stacks: the one caller "
        "stores the result into codes[rows] with no rows, so an empty or (1, 4) array of any value writes nothing"
        for shape, value, dtype in (
            ("(0, 4)", "None", "dtype=np.int64"),
            ("(0, 4)", "-1", "dtype=None"),
            ("(1, 4)", "-1", "dtype=np.int64"),
            ("(0, 4)", "+1", "dtype=np.int64"),
            ("(0, 4)", "-2", "dtype=np.int64"),
        )
    },
    ("Frames.codes", "return np.full((0, 4), -1, )"): "an empty list of stacks writes nothing (see above)",
    ("Frames.codes", "list_ids = np.fromiter(map(id, stacks), dtype=None, count=n)"): "ids as float64 are exact "
    "below 2**53 and CPython's ids are addresses below 2**47 on 64-bit Linux: np.unique groups them the same",
    ("Frames.codes", "full = np.fromiter(map(len, stacks), dtype=None, count=n)"): "stack depths as floats compare, "
    "take their minimum and cast to uint64 exactly as ints do",
    **{
        ("Frames.codes", line): "count only preallocates: np.fromiter reads the same items without it"
        for line in (
            "list_ids = np.fromiter(map(id, stacks), dtype=np.uint64, )",
            "full = np.fromiter(map(len, stacks), dtype=np.int64, )",
            "col = np.fromiter(map(id, map(itemgetter(p), sub)), dtype=np.uint64, )",
        )
    },
    **{
        ("Frames.codes", line): "another mix of the same frame ids into one key per stack: stacks still get "
        "distinct keys unless two hashes meet, which the mix makes no likelier for any real input"
        for line in (
            "key = full.astype(np.uint64) * _MIX[1]",
            "col *= _MIX[(p - 1) % len(_MIX)]",
            "col *= _MIX[(p + 2) % len(_MIX)]",
            "col ^= col << np.uint64(29)",
            "col ^= col >> np.uint64(30)",
            "key[rows] -= col",
        )
    },
    ("Frames.codes", "col = col >> np.uint64(29)"): "each frame still adds a 35-bit hash of its id (ids are distinct "
    "addresses): keys of distinct stacks meet with odds of about n**2 / 2**35, negligible for the stacks of a trace",
    ("Frames.codes", "key = full.astype(None) * _MIX[0]"): "float64 keys: the same stack sums to the same key, "
    "distinct ones keep 53 bits of their hash apart",
    **{
        ("Frames.codes", f"rows = np.flatnonzero(lens > p) if {cond} else np.flatnonzero(full > 0)"): "at p = 0 "
        "both pick the stacks with a frame (lens = min(depth, cut) with cut >= 1, so lens > 0 iff depth > 0)"
        for cond in ("p > 0", "p >= 1")
    },
    ("Frames.codes", "rows = np.flatnonzero(lens > p) if p >= 0 else np.flatnonzero(full > 1)"): "a stack of one "
    "frame already hashed it as its first (cut >= 1): only the redundant outermost term is left out",
    ("Frames.codes", "sub = stacks if (len(rows) == n) and False else list(map(stacks.__getitem__, rows.tolist()))"): (
        "a copy of the list where the list itself would do: the same items"
    ),
    **{
        ("Frames.codes", f"table = np.array([self.decode(stacks[i], with_text) for i in first.tolist()], {arg})"): (
            "rows of Python ints make an int64 array without the dtype (numpy's default int on 64-bit Linux)"
        )
        for arg in ("dtype=None", "")
    },
    **{
        ("Frames.codes", f"return table[inverse.reshape({arg})]"): "np.unique's inverse of a 1-D key is already "
        "1-D (numpy 2), and reshape(None) or reshape(-2) keep that shape"
        for arg in ("None", "-2")
    },
    # ---- snapshot_write.py
    **{
        ("write_snapshot", f"pickle.dump(data, f, {arg})"): "pickle.DEFAULT_PROTOCOL is 4 on the Python this runs "
        "(3.11); from 3.14 on it is 5, and this mutant would write a file the viz cannot read"
        for arg in ("protocol=None", "")
    },
    **{
        ("_snapshot_of", f'for i, (action, key) in enumerate(zip(c["action"], c["storage"], {arg})):'): "a "
        "Timeline's columns all have its length"
        for arg in ("strict=None", "", "strict=False")
    },
    **{
        ("_snapshot_of", f"spaces = {{d: _Addresses(_ADDRESS_BASE {sign} d * {step}) for d in indices.values()}}"): (
            "each device's range 1 or 2 TiB from the next, above or below the base: still disjoint (a device's "
            "one segment would need a TiB to reach the next) and 2 MiB aligned"
        )
        for sign, step in (("-", "(1 << 40)"), ("+", "(2 << 40)"), ("+", "(1 << 41)"))
    },
    **{
        ("_snapshot_of", f'_add_block(blocks[d], spaces[d], nbytes, stack(code, PHASE_CODE["other"], {op}, {fr}))'): (
            "-2 is outside the op and frame tables as -1 is: the same marker-only stack, cached under another key"
        )
        for op, fr in (("-2", "-1"), ("-1", "-2"))
    },
    **{
        ("_snapshot_of", f's = stack(c["category"][i], PHASE_CODE["other"], {op}, {fr})'): "the stack of the block "
        "of a pre-window storage freed in the window: that block is popped at its free, so its stack is never "
        "written (a stack built under this key holds what the key names, for any later entry that uses it)"
        for op, fr in (("+1", "-1"), ("-2", "-1"), ("-1", "+1"), ("-1", "-2"))
    },
    ("_snapshot_of", 'before_addr[i] = _add_block(blocks[d], spaces[d], c["bytes"][i], None)'): "that block (of a "
    "pre-window storage freed in the window) is popped at its free: its state and frames are never written",
    ("_snapshot_of", "s = None"): "the stack of the block of a pre-window storage freed in the window: that block is "
    "popped at its free, so its state and frames are never written",
    ("_snapshot_of", 'end_us = zero_us + round((c["time"][-1] if c["time"] else 1.0) * 1e6)'): "only a timeline "
    "without events takes the else, and its traces are empty: no snapshot entry carries end_us",
    **{
        ("_device_indices", f"return {{n: int(x[1]) for n, x in zip(names, m, {arg})}}"): "m is built from names, "
        "one match per name: the same length"
        for arg in ("strict=None", "", "strict=False")
    },
    # ---- snapshot.py
    **{
        ("_device_events", line): "count only preallocates: np.fromiter reads the same items without it"
        for line in (
            'act = np.fromiter(map(_ACTIONS.get, map(itemgetter("action"), trace), repeat(-1)), np.int8, )',
            'addr = np.fromiter(map(itemgetter("addr"), sel), np.int64, )',
            'size = np.fromiter(map(itemgetter("size"), sel), np.int64, )',
            'time_us = np.fromiter(map(itemgetter("time_us"), sel), np.float64, )',
        )
    },
    (
        "_device_events",
        'act = np.fromiter(map(_ACTIONS.get, map(itemgetter("action"), trace), repeat(-1)), None, len(trace))',
    ): ("action codes as float64 compare to 0, 1 and 2 the same"),
    (
        "_device_events",
        'act = np.fromiter(map(_ACTIONS.get, map(itemgetter("action"), trace), repeat(-2)), np.int8, len(trace))',
    ): ("-2 is no action code, as -1 is not: those entries are dropped either way"),
    ("_device_events", 'addr = np.fromiter(map(itemgetter("addr"), sel), None, n)'): "addresses as float64 are exact "
    "below 2**53 (GPU virtual addresses are below 2**49): they pair and cast to int64 the same",
    ("_device_events", 'time_us = np.fromiter(map(itemgetter("time_us"), sel), None, n)'): "np.fromiter's default "
    "dtype is float64, the one given",
    **{
        ("_device_events", line): "a copy of the list where the list itself would do: the same items"
        for line in (
            "sel = trace if (len(keep) == len(trace)) and False else list(map(trace.__getitem__, keep.tolist()))",
            "picked = stacks if (len(rows) == n) and False else list(map(stacks.__getitem__, rows.tolist()))",
        )
    },
    **{
        (
            "_device_events",
            f"named = np.array([_FOREIGN_CATEGORY.get(c, -1) if isinstance(c, str) else -1 for c in foreign], {arg})",
        ): ("a list of Python ints makes an int64 array without the dtype (numpy's default int on 64-bit Linux)")
        for arg in ("None", "")
    },
    **{
        (
            "_device_events",
            "named = np.array([_FOREIGN_CATEGORY.get(c, "
            f"{a}) if isinstance(c, str) else {b} for c in foreign], np.int64)",
        ): "any negative category code is none: the marker's wins only when >= 0, what stays negative gets the default"
        for a, b in (("-2", "-1"), ("-1", "-2"))
    },
    ("_device_events", '"action": np.where(is_alloc, ALLOC, FREE).astype(None),'): "float64 0 and 1: Timeline casts "
    "the action column to int8",
    **{
        (
            "_device_events",
            f'"device": np.full(n, device, {arg}),',
        ): "np.full of a Python int is int64 without the dtype"
        for arg in ("dtype=None", "")
    },
    **{
        ("_pair", line): "np.full takes the dtype of its fill value when given none: int64 for -1"
        for line in ("alloc_of = np.full(n, -1, dtype=None)", "alloc_of = np.full(n, -1, )")
    },
    ("_pair", "alloc_of = np.full(n, -2, dtype=np.int64)"): "any negative marks a free allocated before the trace: "
    "the one reader tests alloc_of >= 0",
    ("_pair", "return alloc_of, np.zeros(1, dtype=bool), set()"): "with no events the (1,) mask broadcasts against "
    "the empty has_alloc to the same empty mask",
    **{
        ("_pair", f"return alloc_of, act == FREE, set(zip(d[live].tolist(), a[live].tolist(), {arg}))"): "d[live] "
        "and a[live] take the same rows: the same length"
        for arg in ("strict=None", "", "strict=False")
    },
    **{
        ("_events", line): "Timeline() casts every column to its schema dtype (time is float64): the same values"
        for line in (
            '{name: np.zeros(0, dtype=np.float64 if (name == "time") and False else np.int64) for name, _ in COLUMNS},',
            '{name: np.zeros(0, dtype=np.float64 if name == "XXtimeXX" else np.int64) for name, _ in COLUMNS},',
            '{name: np.zeros(0, dtype=np.float64 if name == "TIME" else np.int64) for name, _ in COLUMNS},',
            'cols["time"] = np.arange(len(t), dtype=None)',
            'cols["time"] = np.arange(len(t), )',
        )
    },
    ("_events", "if len(per_device) >= 1:"): "one device's times are already nondecreasing (the maximum.accumulate "
    "above): its stable sort is the identity",
    (
        "_events",
        'order = np.argsort(t, kind="STABLE")',
    ): "numpy reads the sort kind by its first letter, in either case",
    **{
        ("_events", f'return cols, free_actions, "s", [(d, e, t) for (d, e), t in zip(ooms, at, {arg})]'): "at is "
        "built from ooms, one time per error: the same length"
        for arg in ("strict=None", "", "strict=False")
    },
    **{
        ("_Segments.device", line): "float64 baselines: sums of whole byte counts are exact below 2**53, and the one "
        "reader casts each with int()"
        for line in (
            "self.baseline[d] = np.zeros(len(CATEGORIES), dtype=None)",
            "self.baseline[d] = np.zeros(len(CATEGORIES), )",
        )
    },
    ("_to_timeline", "pre_freed = pre_freed.astype(None).reshape(len(used), k)"): "float64 sums of whole byte counts "
    "are exact below 2**53, and the baseline is cast with int()",
    ("_Segments._segment", 'code = frames.decode(b.get("frames"), with_text=None)[0]'): "None is falsy like False: "
    "decode skips the text and the phase either way",
    **{
        ("_phase_of_frees", f"if not ({cond}).any():"): "the early return is a shortcut: when it is not taken, the "
        "loop below (whose own test is unchanged) fills nothing more"
        for cond in ("~is_alloc | (phase < 0)", "~is_alloc & (phase <= 0)", "~is_alloc & (phase < 1)")
    },
    ("_phase_of_frees", "last = np.maximum.accumulate(np.where(allocs, np.arange(len(rows)), -2))"): "any negative "
    "means no alloc before: the fill tests last >= 0",
    ("_to_timeline", "remap = np.zeros(max(used, default=1) + 1, dtype=np.int64)"): "only a snapshot with no device "
    "at all takes the default, and its device column is empty: the table is never read",
    ("_to_timeline", "remap = np.zeros(max(used, default=0) + 2, dtype=np.int64)"): "one spare entry at the end, "
    "which no device index reaches",
    ("load_snapshot", "return data if (isinstance(data, dict)) and False else dict(data)"): "a shallow copy of a "
    "dict of a few keys: the same keys, the same (shared) values",
    # ---- comparison.py
    **{
        (function, line): "float('NAN') is NaN as float('nan') is (float() reads the case-insensitive 'nan')"
        for function, line in (
            (
                "Comparison.from_timelines",
                'return cls(results=results, mode=mode, tolerance=float("NAN"), baseline=baseline)',
            ),
            (
                "Comparison.table",
                'row["time vs baseline"] = r.seconds / base.seconds if base.seconds > 0 else float("NAN")',
            ),
            ("Comparison.table", 'row[check] = r.checks.get(check, float("NAN"))'),
            ("_time_steps", 'return float("NAN")'),
        )
    },
    **{
        ("Comparison.table", line): "a check column always holds a number from some variant, so pandas stores "
        "the missing None as NaN in that float column"
        for line in ("row[check] = r.checks.get(check, None)", "row[check] = r.checks.get(check, )")
    },
    (
        "_scale_of",
        "return max(1.0, float(t.float().abs().max())) if t.numel() else 2.0",
    ): "only an empty tensor gets it, whose difference is 0.0: 0 <= tolerance x any positive scale (tolerance > 0)",
    ("_differences", "if got.params is not None or ref.params is not None:"): "compare() checks up front that every "
    "variant's step has the comparison's mode, so both or neither have parameters (training <=> params)",
    # ---- tracker.py
    ("Tracker.__init__", "self._t0 = None"): "start() sets the clock before the mode records anything",
    **{
        (function, line): "_closed is set just before stop() clears _live and _host, which drops every weakref and "
        "so cancels its callback: no callback ever finds the tracker closed or its key missing"
        for function, line in (
            ("Tracker.__init__", "self._closed = None"),
            ("Tracker.stop", "self._closed = None"),
            ("Tracker.stop", "self._closed = False"),
            ("Tracker._on_free", "entry = self._live.pop(key, )"),
            ("Tracker._on_free", "if entry is None and self._closed:"),
            ("_Roles._on_host_free", "entry = self._host.pop(key, )"),
            ("_Roles._on_kept_free", "entry = self._kept.pop(key, )"),
        )
    },
    ("_Roles._on_kept_free", "if entry is not None or not self._closed:"): "a kept storage's entry is always there "
    "when its callback runs (see above), and host_state_bytes is read once, in stop(), before _closed is set and the "
    "kept weakrefs are dropped: a free recorded after it is never read",
    **{
        ("Tracker._op_info", line): "a cache miss every time: the same op info, recomputed (ops are interned by name)"
        for line in (
            "info = None",
            "info = self._ops.get(None)",
            "info = self._ops.get(id(None))",
            "self._ops[id(func)] = None",
            "self._ops[id(None)] = info",
        )
    },
    ("Tracker._record_outputs", "for t in out if isinstance(out, (tuple, list)) else tree_flatten(None)[0]:"): (
        "an aten op returns a Tensor, a tuple or a list (all handled before), or no tensor at all"
    ),
    (
        "Tracker._resolve_saved",
        "saved = getattr(node, attr, None) if (node is not None) or True else None",
    ): "getattr(None, attr, None) is None, the else value",
    **{
        (function, line): "bookkeeping of the numbers a node saved, looked up only for the node running its "
        "backward: autograd releases a node's saved numbers together, after its backward ran (or with the graph), "
        "and a node never runs again, so a stale or partly cleared entry is never read"
        for function, line in (
            ("Tracker._resolve_saved", "self._saved_node[skey] = None"),
            ("Tracker._on_free", "seq = None"),
            ("Tracker._on_free", "seq = self._saved_node.pop(None, None)"),
            ("Tracker._on_free", "seq = self._saved_node.pop(key, )"),
            ("Tracker._on_free", "held = None"),
            ("Tracker._on_free", "held = self._saved_by_node.get(None)"),
            ("Tracker._on_free", "if held is None:"),
            ("Tracker._on_free", "held[:] = [h for h in held if h[1] != key]"),
            ("Tracker._on_free", "held[:] = [h for h in held if h[0] == key]"),
            ("Tracker._on_free", "if held:"),
        )
    },
    ("Tracker.stop", "_watch_outside_dispatch(None)"): "None is falsy like False: the same branch",
    ("Tracker._device_code", "code = None"): "a cache miss every time: the same device code (names are interned)",
    (
        "_Roles.register",
        "self._live[key] = _Live(-1, n, code, None, weakref.ref(s, partial(self._on_free, key, device)))",
    ): "a pre-window entry's phase is read only by _backward_started, which skips pre-window entries (event < 0)",
    (
        "_Roles.register",
        "self._live[key] = _Live(-2, n, code, _OTHER, weakref.ref(s, partial(self._on_free, key, device)))",
    ): "every reader tests event >= 0: -2 marks a pre-window storage as -1 does",
    **{
        (function, line): "recurse=None is falsy: torch takes the module alone, as with recurse=False"
        for function, line in (
            ("_Roles.register_module", "params = list(m.parameters(recurse=None))"),
            ("_Roles.register_module", 'self.register(m.buffers(recurse=None), "buffer")'),
            ("Tracker._forward_pre", "self.register_module(module, recurse=None)"),
        )
    },
    ("Tracker._forward_pre", "if id(None) not in self._seen_modules:"): "register_module skips a module already "
    "seen itself: the same registration",
    **{
        (function, line): "no workspace function reads out: the formulas, wrapped numbers and learned sizes all "
        "come from the arguments"
        for function, line in (
            ("Tracker._flag_lower_bound", "return fn(args, kwargs, None) if fn is not None else 0"),
            (
                "Tracker._record_outputs",
                "extra = workspace_fn(args, kwargs, None) if workspace_fn is not None and not _OFF_DEVICE.get() else 0",
            ),
        )
    },
    **{
        ("Tracker._flag_lower_bound", line): "fn is never None here: lower_bound_fn is set only for learnable ops "
        "measured for the CPU, for which workspace_fn always returns a function"
        for line in (
            "return fn(args, kwargs, out) if (fn is not None) or True else 0",
            "return fn(args, kwargs, out) if fn is not None else 1",
        )
    },
    # ---- workspace/
    **{
        ("cpu_flags", line): "a /proc/cpuinfo flags line has one ':' (flag names are letters, digits and '_')"
        for line in (
            'return frozenset(line.split(":", )[1].split())',
            'return frozenset(line.rsplit(":", 1)[1].split())',
            'return frozenset(line.split(":", 2)[1].split())',
        )
    },
    **{
        ("missing_flags", f"return sorted(set(ONEDNN_ISAS[_ALIASES.get({arg}) or isa]) - flags)"): "a name that is "
        "not an alias falls back to itself through 'or isa' whatever get() returns for it"
        for arg in ("isa, None", "isa", "isa, ")
    },
    **{
        (function, line): "an op's schema name is always 'namespace::name', with one '::'"
        for function, line in (
            ("_op_name", 'return func._schema.name.split("::")[+1]'),
            ("saved_scalars_fn", 'name = func._schema.name.split("::")[+1]'),
            ("_resolve", 'namespace, _, opname = name.rpartition("::")'),
        )
    },
    ("saved_scalars_fn", 'if name.endswith("_") and not name.endswith("XX__XX"):'): "no dunder op (__and__, "
    "__lshift__...) is among the ops whose backward saves a number, trimmed or not",
    ("workspace_fn", "n = _wrapped_scalars(slots, args) if (slots) or True else 0"): "_wrapped_scalars of no slots "
    "is 0",
    ("_tensor", "base.uniform_(-1, )"): "uniform_'s upper bound defaults to 1",
    **{
        (function, line): "the length prefix of a request or answer (a few hundred bytes of shapes and numbers) is "
        "far below 2**31, where signed and unsigned 4-byte integers agree"
        for function, line in (
            ("_read", '(n,) = struct.unpack(">i", head)'),
            ("_write", 'stream.write(struct.pack(">i", len(data)) + data)'),
            ("_ask", 'worker.stdin.write(struct.pack(">i", len(data)) + data)'),
        )
    },
    **{
        (function, line): "both ends of the pipe are the same Python, which reads every protocol it writes"
        for function, line in (
            *(("_write", f"data = pickle.dumps(obj, {arg})") for arg in ("protocol=None", "", "protocol=5")),
            *(
                ("_ask", f"data = pickle.dumps((op, args, kwargs, threads), {arg})")
                for arg in ("protocol=None", "", "protocol=5")
            ),
        )
    },
    **{
        ("enabled", f'return os.environ.get("MEMKIT_LEARN_WORKSPACE", {arg}) != "0"'): "every default but '0' "
        "leaves learning on, as '1' does"
        for arg in ("None", "", '"XX1XX"')
    },
    **{
        (
            "learned_bytes",
            f'func._schema.name + "." + (func._overloadname or "{name}"), spec_args, spec_kwargs, threads',
        ): "an OpOverload's _overloadname is 'default' for the default overload, never empty"
        for name in ("XXdefaultXX", "DEFAULT")
    },
    **{
        (
            "_ask",
            f'warnings.warn(f"memkit: {{_broken}}; ops it would have measured are flagged as lower bounds", {arg})',
        ): "the stack level only changes which line the warning names; its text is tested"
        for arg in ("", "stacklevel=3")
    },
    ("_start", "stderr=None,"): "the worker writes nothing to stderr unless it crashes, and a crash is caught and "
    "said as a warning either way; only a traceback on the terminal would differ",
    **{
        ("_stop", f"worker.wait(timeout={arg})"): "the worker exits as soon as its stdin closes; the timeout only "
        "bounds a worker that hangs, which no test can make happen within it"
        for arg in ("None", "6")
    },
    ("flash_cpu_forward", "q, k = args[0], args[2]"): "key and value have the same length in every attention "
    "call, and the formula reads only the key's length",
    # ---- _roles.py: see tracker.py above (the methods moved there keep their reasons)
    ("_Roles._host_state_bytes", "peak[category] = max(peak.get(category, 1), live[category])"): "a category's first "
    "host-state event is an allocation of at least one byte (_keep takes only storages with bytes, and all of a "
    "storage's events count under its one category), so its peak is at least 1 either way",
    # ---- _fake_dispatch.py
    ("FakeDispatchCache._first", "before = [_meta(t) for t in tensors] if (kind == 2) or True else None"): "before is "
    "read only for in-place ops (kind 2): computed for the others, it is dropped",
    (
        "_entry_of",
        "if out is None or (isinstance(out, (list, tuple)) and out):",
    ): "None gives the in-place entry either "
    "way, and a list, empty or not, gives no entry either way (the line after, or the tests below it)",
    (
        "_entry_of",
        'return ("inplace", None) if (out is None) or True else None',
    ): "differs only for an in-place op that returns an empty list, and none can: no mutable aten op named with a "
    "trailing '_' returns a list (checked over every aten overload's schema)",
    **{
        (
            "extent",
            f"return 1 + sum((n - 1) * st for n, st in zip(shape, stride, {arg})) if all(shape) else 0",
        ): "shape and stride are one tensor's own: the same length"
        for arg in ("strict=None", "", "strict=False")
    },
    ("_view_entry", "if not outs and not all(isinstance(t, FakeTensor) for t in outs):"): "a view op's outputs under "
    "FakeTensorMode are all fake tensors; with none (unbind of an empty dimension) the empty list it caches replays as "
    "the empty list fake dispatch gives",
    (
        "_view_entry",
        "if t.untyped_storage()._cdata != storage and t.constant is not None or t.is_conj() or t.is_neg():",
    ): "an aten view op's outputs are on its one tensor argument's storage, and a constant argument never gets a key "
    "(_key_of bypasses it): both tests dropped are always false",
    **{
        ("_view", f'empty = torch.empty_strided(shape, stride, dtype=dtype, device="meta", {arg})'): "a view entry's "
        "requires_grad is False: the estimate calls the cache below autograd (the tracker's dispatch mode), where no "
        "output requires grad (above it, a view of a tensor that requires grad cannot be replayed: set_ on it raises)"
        for arg in ("requires_grad=None", "")
    },
    ("_key_of", "return (type(None), tuple([_key_of(x) for x in a]))"): "a list and a tuple are the same aten argument "
    "(int[], Tensor[]): the op gives the same outputs for either",
    **{
        ("FakeDispatchCache._kind", line): "the kinds are shortcuts: a cache miss recomputes the same kind, and None "
        "(falsy, like 0) sends the op to FakeTensorMode, which gives the same outputs (prim.device: the fake device; "
        "item of a constant: the constant's value)"
        for line in (
            "kind = None",
            "kind = self._ops.get(None)",
            "kind = self._ops.get(id(None))",
            "self._ops[id(func)] = None",
            "self._ops[id(None)] = kind",
        )
    },
    **{
        (function, line): "item of a constant then takes the keyed path, where its constant argument bypasses to "
        "FakeTensorMode, which reads the constant's value as the shortcut does (and refuses a value it does not know "
        "alike)"
        for function, line in (
            ("FakeDispatchCache._kind", "kind = 6"),
            (
                "FakeDispatchCache.__call__",
                "if kind == 6:  # .item() of a constant (Adam's step count): fake dispatch "
                "reads the value it propagated",
            ),
            ("FakeDispatchCache.__call__", "if isinstance(t, FakeTensor) and t.constant is not None and kwargs:"),
        )
    },
    ("FakeDispatchCache._kind", "returns_alias = None"): "every non-mutable op whose return aliases an argument is a "
    "view (OpOverload.is_view), taken by the branch before; a mutable one skips this branch either way",
    (
        "FakeDispatchCache._kind",
        'elif schema.is_mutable or schema.name.endswith("_"):  # add_, _foreach_mul_: not out= variants',
    ): "adds out= variants to the in-place path, which replays an op only when its first call changed no "
    "argument's metadata (the out= tensors are keyed arguments) and returned nothing or its first argument: the same "
    "outputs and metadata as running it",
    **{
        ("FakeDispatchCache.__call__", line): "prim.device then goes to FakeTensorMode, which gives the fake device too"
        for line in (
            "return t.fake_device if (isinstance(t, FakeTensor) and not kwargs) and False else func(*args, **kwargs)",
            "return t.fake_device if isinstance(t, FakeTensor) and kwargs else func(*args, **kwargs)",
        )
    },
    **{
        ("FakeDispatchCache.__call__", line): "prim.device and _local_scalar_dense take no keyword arguments"
        for line in (
            "return t.fake_device if isinstance(t, FakeTensor) and not kwargs else func(*args, )",
            "return func(*args, )",
        )
    },
    (
        "FakeDispatchCache.__call__",
        "key = (id(func), _key_of(args), _key_of(tuple(kwargs.items())) if (kwargs) or True else None)",
    ): "a call without keyword arguments keys them as _key_of(()) instead of None: another constant in the same place "
    "of every such key",
    **{
        ("_entry_of", line): "no op that makes new tensors returns one with the conjugate or negative bit (clone and "
        "arithmetic resolve them: checked for clone and mul of _conj and _neg_view views); only those views, a view "
        "kind of their own, set them"
        for line in (
            "if t.constant is not None or t.is_conj() or t.is_neg() and t.layout != torch.strided:",
            "if t.constant is not None or t.is_conj() and t.is_neg() or t.layout != torch.strided:",
            "if t.constant is not None and t.is_conj() or t.is_neg() or t.layout != torch.strided:",
        )
    },
    ("_entry_of", "storages.add(None)"): "two outputs on one new storage would both have to start at offset 0 and span "
    "all of it (the tests after): one tensor returned twice, which no op with non-aliasing returns does",
    **{
        (
            "_entry_of",
            f"return ({tag}, (infos, container))",
        ): "_replay tells only 'inplace' and 'view' apart: any other tag replays new tensors"
        for tag in ('"XXnewXX"', '"NEW"')
    },
    # ---- _memo.py
    (
        "_identical",
        "middle = _signature(blocks[2])",
    ): "every list checked has at least 4 blocks (longer than the probe, "
    "or a probe), so blocks 1 and 2 are both middle blocks: all middle blocks equal the one iff they equal the other",
    ("_identical", "return all(_signature(b) == middle for b in list(blocks)[2:-1])"): "block 1's is the signature "
    "compared against: leaving block 1 out of the comparison changes nothing",
    **{
        ("probe_builder", f"marked = set(config.get(marks[key], {arg}) or ())"): "the one marked key (SD3's "
        "dual_attention_layers) defaults to () in its class: None or () reads as no marked layer either way"
        for arg in ("None", "")
    },
    ("probe_builder", "probe = kept(n, probe_length(n, period), )  # the full blocks the probe's are"): "a list is "
    "probed only when its middle layers are all marked or none is, and kept() with any period has the first block "
    "first, the last block last and middle blocks between: the same probe blocks marked",
    # ---- optimizations/__init__.py
    (
        "register",
        'if not spec.name or not spec.name.replace("-", "XXXX").isalpha() or not spec.name.islower():',
    ): "dashes become letters instead of nothing: isalpha() answers the same for every name but one of dashes "
    "only, which islower() rejects either way (it has no cased letter)",
    # ---- optimizations/checkpointing.py
    **{
        (function, line.replace("strict=True", arg)): "the two sequences have the same length by construction "
        "(one is built from the other, or both from the same list)"
        for function, line in (
            (
                "_run_offloaded",
                "host = [_host_copy(x, target) if target is not None else x for x, target in "
                "zip(leaves, targets, strict=True)]",
            ),
            (
                "_run_offloaded",
                "devices = [x.device if target is not None else None for x, target in "
                "zip(leaves, targets, strict=True)]",
            ),
            ("_run_offloaded", "for x, d in zip(flat[len(markers) :], devices, strict=True):"),
            (
                "_run_offloaded",
                "moved = [back[id(x)] if d is not None else x for x, d in "
                "zip(flat[len(markers) :], devices, strict=True)]",
            ),
            (
                "Checkpointing.select",
                "for (name, _), chosen in zip(blocks, _selected(self.pattern, [b for _, b in blocks]), strict=True)",
            ),
            (
                "Checkpointing.apply",
                "return self._apply_diffusers(model, {id(b) for (_, b), c in zip(blocks, chosen, strict=True) if c})",
            ),
            (
                "Checkpointing.apply",
                "return self._apply_wrapped([b for (_, b), c in zip(blocks, chosen, strict=True) if c])",
            ),
        )
        for arg in ("strict=None", "", "strict=False")
    },
    **{
        (function, line): "non_blocking only decides whether a copy between CUDA and host memory waits: the same "
        "values reach every reader (the copy back is ordered on the stream that reads it), and a copy from CPU to "
        "CPU memory is synchronous either way"
        for function, line in (
            ("_to_host", "copy = t.detach().to(host, non_blocking=None, copy=True)"),
            ("_to_host", "copy = t.detach().to(host, copy=True)"),
            ("_to_device", "return t.to(device, non_blocking=None, copy=True)"),
            ("_to_device", "return t.to(device, copy=True)"),
            ("_to_device", 'return t.to(device, non_blocking=device.type != "cuda", copy=True)'),
            ("_to_device", 'return t.to(device, non_blocking=device.type == "XXcudaXX", copy=True)'),
            ("_to_device", 'return t.to(device, non_blocking=device.type == "CUDA", copy=True)'),
        )
    },
    (
        "Checkpointing.apply",
        'warnings.warn(f"budget_bytes: {plan}; checkpointing every block, the least memory", stacklevel=3)',
    ): "the stack level only changes which line the warning names (under mutmut's trampoline another frame "
    "anyway); its text is tested",
    ("_forget", "_host_copies.pop(key, )"): "the entry is always there when its tensor dies: each entry's weakref "
    "is the only one with a callback, and an entry replaced while its tensor lives drops its weakref unfired",
    # ---- optimizations/feedforward.py
    **{
        ("FFSplit.apply", line): "the stack level only changes which line the warning names (under mutmut's "
        "trampoline another frame anyway); its text is tested"
        for line in (")", "stacklevel=3,")
    },
    ("FFSplit.apply", "missing = None"): "a module's own forward is never None (it is called), so None marks "
    "'no forward of its own' as well as a fresh object",
    # ---- optimizations/_ff_chunks.py
    ("_RecomputedSplit.backward", "b1 = b1 if (ctx.has_b1) or True else None"): "save_for_backward gives back None "
    "for the None it was given: without a bias b1 is None either way",
    **{
        ("_RecomputedSplit.backward", f"for (r0, r1), g in zip(rows, grads, {arg}):"): "one row range per part "
        "the gradients are taken of (one, or two gated): the same length by construction"
        for arg in ("strict=None", "", "strict=False")
    },
    ("_RecomputedSplit.backward", "gx = gx.to(None)"): "autograd casts a Function's returned gradient to its "
    "input's dtype anyway (fp32-accumulated bf16/fp16 gradients come back in the input's dtype)",
    **{
        ("_MLP.params", line): "find_mlps returns only layers whose out-projection reads exactly the inner columns "
        "(out_start 0) or starts at out_start > 0 (Flux): slicing all columns is a view of the same values"
        for line in (
            "if self.out_start and w2.shape[1] != self.inner:",
            "if self.out_start or w2.shape[1] == self.inner:",
        )
    },
    **{
        (
            "_sequence_split",
            "tiles = [t for t in zip(*(torch.tensor_split(a, splits, dim=axis) for a in xs), "
            f"{arg}) if t[0].shape[axis]]",
        ): "tensor_split returns exactly splits pieces of every tensor, so the lists zipped have the same length"
        for arg in ("strict=None", "", "strict=False")
    },
    # ---- optimizations/_ema_state.py
    (
        "EMAState.__init__",
        "self.config = replace(config or EMA(), **settings) if (settings) or True else (config or EMA())",
    ): "replace() with no settings makes an equal copy of the frozen config: the same values, compared by value",
    (
        "EMAState.save_pretrained",
        'def save_pretrained(self, path: str | os.PathLike, *, max_shard_size: int | str = "10gb") -> None:',
    ): "huggingface_hub's parse_size_to_int reads a size's unit case-insensitively: '10gb' is '10GB'",
    **{
        ("EMAState.save_pretrained", line): "safetensors' save_file copies a tensor that is not on the CPU to the "
        "CPU itself (safetensors/torch.py _tobytes): the same bytes in the file"
        for line in (
            "tensors = {n: s.detach().to(None).contiguous() for n, s in zip(names, self.shadow_params, strict=True)}",
            "tensors.update({n: b.detach().to(None).contiguous() for n, b in self._buffers.items()})",
        )
    },
    **{
        (
            "EMAState.save_pretrained",
            f'tensors = {{n: s.detach().to("cpu").contiguous() for n, s in zip(names, self.shadow_params, {arg})}}',
        ): "names has one entry per shadow by construction (the model's named_parameters, or one per position)"
        for arg in ("strict=None", "", "strict=False")
    },
    **{
        ("EMAState.save_pretrained", f"shard = {{k: tensors[k] if {cond} else tensors[k].clone() for k in keys}}"): (
            "the installed safetensors (0.8) refuses only tensors whose bytes overlap (torch.py "
            "_filter_shared_not_shared), and the shadows' views are disjoint: cloned or not, the same file"
        )
        for cond in ("(_alone(tensors[k])) and False", "(_alone(tensors[k])) or True")
    },
    ("_alone", "return t.untyped_storage().nbytes() != t.nbytes"): "its one caller chooses whether to clone a "
    "tensor before safetensors writes it, and a clone writes the same bytes (see save_pretrained above)",
}
"""Surviving mutants that change no observable behaviour, with the reason. Matched by function and mutated
line (not by mutmut's mutant number, which shifts when a function changes): an entry that stops matching
simply lets the mutant count as a survivor again."""

KILLED = {"killed", "segfault", "caught by type check"}
TIMEOUT = {"timeout"}
NOT_RUN = {"not checked", "check was interrupted by user", "skipped"}


@dataclass
class Result:
    """One module's run."""

    name: str
    target: str
    tests: list[str]
    status: dict[str, str] = field(default_factory=dict)  # mutant name -> mutmut status
    diffs: dict[str, str] = field(default_factory=dict)  # mutant name -> diff, for those not killed
    skipped: list[str] = field(default_factory=list)  # decorated functions, which mutmut leaves alone
    equivalent: dict[str, str] = field(default_factory=dict)  # mutant name -> reason
    seconds: float = 0.0
    error: str | None = None
    date: str = ""
    commit: str = ""

    def count(self, statuses: set[str]) -> int:
        return sum(s in statuses for s in self.status.values())

    def row(self) -> dict:
        killed, timeout = self.count(KILLED), self.count(TIMEOUT)
        not_run = self.count(NOT_RUN)
        equivalent = len(self.equivalent)
        survived = len(self.status) - killed - timeout - not_run - equivalent
        judged = len(self.status) - not_run - equivalent
        return {
            "module": f"`{self.target}`",
            "mutants": len(self.status),
            "killed": killed,
            "timeout": timeout,
            "survived": survived,
            "equivalent": equivalent,
            "not run": not_run,
            "unmutated functions": len(self.skipped),
            "% killed": f"{100 * (killed + timeout) / judged:.1f}" if judged else "-",
        }


def _function(mutant: str) -> str:
    """``memkit.memory.timeline.xǁTimelineǁpeak_index__mutmut_3`` -> ``Timeline.peak_index``."""
    mangled = mutant.rsplit("__mutmut_", 1)[0].rsplit(".", 1)[-1]
    if mangled.startswith("xǁ"):
        return mangled[2:].replace("ǁ", ".")
    return mangled[2:] if mangled.startswith("x_") else mangled


def _added_line(diff: str) -> str:
    added = [ln[1:].strip() for ln in diff.splitlines() if ln.startswith("+") and not ln.startswith("+++")]
    return " / ".join(added)


def _decorated(target: str) -> list[str]:
    """Functions of ``target`` that mutmut 3 does not mutate: those with a decorator other than one lone
    ``@staticmethod`` or ``@classmethod`` (``@property``, ``@contextlib.contextmanager``...)."""
    out = []
    for path in sorted(ROOT.glob(target)):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
        for node in ast.walk(tree):
            if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) or not node.decorator_list:
                continue
            decorators = [ast.unparse(d) for d in node.decorator_list]
            if decorators in (["staticmethod"], ["classmethod"]):
                continue
            owner = parents.get(node)
            name = f"{owner.name}.{node.name}" if isinstance(owner, ast.ClassDef) else node.name
            out.append(f"`{name}` ({path.relative_to(ROOT)}:{node.lineno}, @{', @'.join(decorators)})")
    return out


def _mutmut(args: list[str], cwd: Path, **kwargs) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_WAIT_POLICY=os.environ.get("OMP_WAIT_POLICY", "PASSIVE"), PYTHONWARNINGS="ignore")
    return subprocess.run([sys.executable, "-m", "mutmut", *args], cwd=cwd, env=env, text=True, **kwargs)


def _prepare(
    work: Path,
    target: str,
    tests: list[str],
    multiplier: float,
    constant: float,
    markers: str | None = None,
    keywords: str | None = None,
) -> None:
    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)
    ignore = shutil.ignore_patterns("__pycache__", ".hypothesis", ".pytest_cache")
    shutil.copytree(ROOT / "memkit", work / "memkit", ignore=ignore)
    shutil.copytree(ROOT / "tests", work / "tests", ignore=ignore)
    config = {
        "source_paths": ["memkit"],
        "only_mutate": [target],
        "pytest_add_cli_args_test_selection": tests,
        "pytest_add_cli_args": ["-p", "no:cacheprovider", "-q"]
        + (["-m", markers] if markers else [])
        + (["-k", keywords] if keywords else []),
        "timeout_multiplier": multiplier,
        # torch is not fork-safe once its thread pool has run: a mutant forked from the process that ran the
        # tests can hang. A fork server that only imported the tests forks cleanly.
        "process_isolation": "forkserver",
        "timeout_constant": constant,
    }
    lines = ["[tool.mutmut]"] + [f"{k} = {json.dumps(v)}" for k, v in config.items()]
    lines += ["", "[tool.pytest.ini_options]", 'testpaths = ["tests"]', ""]
    (work / "pyproject.toml").write_text("\n".join(lines), encoding="utf-8")


def run_module(
    name: str,
    *,
    jobs: int,
    multiplier: float,
    constant: float,
    max_seconds: float | None,
    commit: str = "?",
    collect: bool = False,
) -> Result:
    """Mutate one module of ``MODULES`` against its test files; the mutants' statuses and the survivors' diffs.
    ``collect``: run nothing, read the last run's statuses from ``build/mutation/<name>/`` (after an entry is added
    to ``EQUIVALENT``); its date, duration and commit are the run's."""
    target, wanted = MODULES[name]
    tests = [t for t in wanted if (ROOT / t).is_file()]
    date = datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")
    result = Result(name=name, target=target, tests=tests, skipped=_decorated(target), date=date, commit=commit)
    if not tests:
        result.error = f"none of its test files exist: {', '.join(wanted)}"
        return result
    work = WORK / name
    if collect:
        if not (work / "run.json").is_file():
            result.error = f"no finished run to collect in {work}"
            return result
        for key, value in json.loads((work / "run.json").read_text(encoding="utf-8")).items():
            setattr(result, key, value)
        return _collect(result, work)
    _prepare(work, target, tests, multiplier, constant, MARKERS.get(name), KEYWORDS.get(name))
    t0 = time.perf_counter()
    with open(work / "mutmut.log", "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "mutmut", "run", "--max-children", str(jobs)],
            cwd=work,
            env=dict(os.environ, OMP_WAIT_POLICY=os.environ.get("OMP_WAIT_POLICY", "PASSIVE")),
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            proc.wait(timeout=max_seconds)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait()
            result.error = f"stopped after --max-seconds {max_seconds:.0f}; the mutants not reached are 'not run'"
    result.seconds = time.perf_counter() - t0
    run = {"date": result.date, "seconds": result.seconds, "error": result.error, "commit": commit}
    (work / "run.json").write_text(json.dumps(run), encoding="utf-8")
    return _collect(result, work)


def _collect(result: Result, work: Path) -> Result:
    listing = _mutmut(["results", "--all", "true"], work, capture_output=True)
    for line in listing.stdout.splitlines():
        mutant, sep, status = line.strip().rpartition(": ")
        if sep and "__mutmut_" in mutant:
            result.status[mutant] = status
    log_text = (work / "mutmut.log").read_text(errors="replace")
    if not result.status and result.skipped:
        result.error = "no mutants: every function here is decorated (see 'Not mutated')"
        return result
    if not result.status:
        tail = log_text[-3000:]
        result.error = (result.error or "mutmut produced no mutants") + "\n" + re.sub(r"[^\n]*\r", "", tail)
        return result
    if result.count(NOT_RUN) == len(result.status) and not result.error:
        said = [ln for ln in re.sub(r"[^\n]*\r", "", log_text).splitlines() if ln.strip()][-3:]
        result.error = "mutmut ran no mutant (its clean run of the tests must pass first):\n" + "\n".join(said)
    if "could not find any test case for any mutant" in log_text:  # mutmut stops before running any
        result.status = dict.fromkeys(result.status, "no tests")
        result.error = "no selected test reaches any mutated function"
    for mutant, status in result.status.items():
        if status in KILLED or status in NOT_RUN:
            continue
        diff = _mutmut(["show", mutant], work, capture_output=True).stdout
        diff = "\n".join(ln for ln in diff.splitlines() if not ln.startswith("# "))
        reason = EQUIVALENT.get((_function(mutant), _added_line(diff)))
        if reason and status not in TIMEOUT:
            result.equivalent[mutant] = reason
        else:
            result.diffs[mutant] = diff.strip()
    return result


# ---- MUTATION.md ---------------------------------------------------------------------------------------------


def _render(result: Result, info: dict[str, str], commit: str) -> str:
    row = result.row()
    commit = result.commit or commit
    parts = [f"<!-- mutation:{result.name} {json.dumps(row)} -->", f"## {result.target}", ""]
    status = f"took {result.seconds:.0f} s" + (" (stopped early)" if result.error else "")
    parts += [
        f"_`python -m bench.mutation {result.name}`, run {result.date}, {status}; commit {commit}; "
        f"torch {info['torch']}, {info['cpu']}, {info['cores']}, load {info['load average (1, 5, 15 min)']}._",
        "",
        "Tests run against each mutant: "
        + ", ".join(f"`{t}`" for t in result.tests)
        + (f' (`-m "{MARKERS[result.name]}"`)' if result.name in MARKERS else "")
        + (f' (`-k "{KEYWORDS[result.name]}"`)' if result.name in KEYWORDS else "")
        + ".",
        "",
        markdown_table([row]),
        "",
    ]
    if result.error:
        parts += ["```", result.error.strip(), "```", ""]
    if result.diffs:
        parts += [f"**Not killed ({len(result.diffs)})**", ""]
        for mutant, diff in result.diffs.items():
            parts += [f"`{mutant}` ({result.status[mutant]}):", "", "```diff", diff, "```", ""]
    if result.skipped:
        parts += [f"**Not mutated ({len(result.skipped)})**: mutmut 3 leaves decorated functions alone", ""]
        parts += [f"- {s}" for s in result.skipped]
        parts.append("")
    if result.equivalent:
        parts += [f"**Equivalent ({len(result.equivalent)})**: no observable behaviour changes", ""]
        parts += [f"- `{m}`: {reason}" for m, reason in result.equivalent.items()]
        parts.append("")
    parts.append(f"<!-- /mutation:{result.name} -->")
    return "\n".join(parts)


def _old_sections(path: Path) -> dict[str, str]:
    if not path.is_file():
        return {}
    text = path.read_text(encoding="utf-8")
    return {m[1]: m[0] for m in re.finditer(r"<!-- mutation:(\w+) .*?<!-- /mutation:\1 -->", text, flags=re.S)}


def write_results(results: list[Result], info: dict[str, str], commit: str, path: Path = RESULTS) -> None:
    """Write ``path``: a summary table of every module run so far, then one section per module (this run's
    modules replace their old sections; the others stay as they were, with their own dates)."""
    blocks = _old_sections(path)
    for result in results:
        blocks[result.name] = _render(result, info, commit)
    order = [n for n in MODULES if n in blocks] + [n for n in blocks if n not in MODULES]
    rows = []
    for name in order:
        head = re.match(r"<!-- mutation:\w+ (\{.*?\}) -->", blocks[name])
        date = re.search(r"run (\d{4}-\d\d-\d\d \d\d:\d\d \w+)", blocks[name])
        rows.append(json.loads(head[1]) | {"run": date[1] if date else "?"})
    never = [f"`{MODULES[n][0]}`" for n in MODULES if n not in blocks]
    text = [
        "# memkit mutation testing",
        "",
        "Written by `python -m bench.mutation` (`make mutate`; see `bench/mutation.py` for how it runs and which "
        "tests each module is checked against). Not run by `make test` or CI. `% killed` = (killed + timeout) / "
        "(mutants - equivalent); the target is at least 90% for `memory/`, `handle`, `compare` and the optimizations. "
        "Each section lists the mutants its tests did not kill, as diffs, and the equivalent ones with the reason.",
        "",
        markdown_table(rows),
        "",
    ]
    if never:
        text += ["Not run yet: " + ", ".join(never) + ".", ""]
    path.write_text("\n".join(text) + "\n" + "\n\n".join(blocks[n] for n in order) + "\n", encoding="utf-8")


def _commit() -> str:
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True).stdout.strip()

    sha = git("rev-parse", "--short", "HEAD") or "?"
    dirty = git("status", "--porcelain", "--", "memkit", "tests")
    return f"{sha}" + (" + uncommitted changes to memkit/ or tests/" if dirty else "")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.mutation",
        description="Mutation testing of memkit (mutmut), one module at a time; writes bench/MUTATION.md.",
    )
    parser.add_argument("names", nargs="*", metavar="MODULE", help=f"modules: {', '.join(MODULES)} (default: all)")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="mutants run at once (default: cores)")
    parser.add_argument("--timeout-multiplier", type=float, default=3.0, help="see the per-mutant timeout above")
    parser.add_argument("--timeout-constant", type=float, default=5.0, help="see the per-mutant timeout above")
    parser.add_argument("--max-seconds", type=float, default=None, help="stop one module's run after this long")
    parser.add_argument("--out", type=Path, default=RESULTS, help=f"markdown file (default: {RESULTS})")
    parser.add_argument(
        "--collect", action="store_true", help="run nothing: re-read the last run's results (after editing EQUIVALENT)"
    )
    args = parser.parse_args(argv)
    unknown = [n for n in args.names if n not in MODULES]
    if unknown:
        parser.error(f"unknown module(s) {', '.join(unknown)}; choose from {', '.join(MODULES)}")
    info, commit = machine(), _commit()
    for i, name in enumerate(args.names or MODULES, 1):
        log(f"[{i}/{len(args.names or MODULES)}] {name}: {MODULES[name][0]}")
        result = run_module(
            name,
            jobs=args.jobs,
            multiplier=args.timeout_multiplier,
            constant=args.timeout_constant,
            max_seconds=args.max_seconds,
            commit=commit,
            collect=args.collect,
        )
        row = result.row()
        log(f"{name}: {row['mutants']} mutants, {row['% killed']}% killed in {result.seconds:.0f} s")
        if result.error:
            log(f"{name}: {result.error.splitlines()[0]}")
        write_results([result], info, commit, args.out)  # after each module, so a later crash keeps it
    log(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
