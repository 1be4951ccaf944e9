"""What learning kernels' internal buffers costs, and what it buys.

A training step tracked with learning on (the default) and off (``MEMKIT_LEARN_WORKSPACE=0``), against the
allocator's own count (torch.profiler).

For each case: the tracker's peak against the profiler's with learning off (how many bytes a tracker that
only knows formulas misses on this CPU, and whether it flags them) and on (must be 0 short, nothing
flagged); the tracked step's time on a cold cache (first step: worker start and every signature learned),
on a warm cache, and untracked, in one run. One thread; forward, loss and backward without an optimizer, so
that the peak falls in the backward, where kernels' buffers count (with AdamW it sits in the update).
"""

from __future__ import annotations

import gc
import os
import time

import torch

import memkit
from memkit.memory import allocator_window, track
from memkit.memory.workspace import cpu_path, learned

from . import Section, Table, log, one_thread

TITLE = "learned_workspace: kernel buffers learned from the allocator, cost and exactness"
CASES = (
    ("unet", "tiny", torch.float32),
    ("unet", "tiny", torch.bfloat16),
    ("flux", "tiny", torch.bfloat16),
    ("wan", "small", torch.bfloat16),
    ("unet", "small", torch.float32),
)


def _tracked(model, inputs, opt, step):
    model.zero_grad(set_to_none=True)
    gc.collect()
    out = {}

    def run():
        with track(model, optimizer=opt, inputs=inputs) as tl:
            step()
        out["tl"] = tl

    with allocator_window() as window:
        run()
    peak = window.peak_bytes
    tl = out["tl"]
    return tl.peak_bytes - tl.baseline_bytes, peak, tl.meta["lower_bound_ops"]


def _case(preset: str, size: str, dtype: torch.dtype) -> dict:
    model = memkit.load_model(preset, size=size, dtype=dtype)
    inputs = memkit.make_inputs(model)
    opt = None

    def step():  # gradients are freed before each window, outside it: every window starts from the same state
        memkit.train_step(model, inputs)

    step()
    learned._cache.clear()
    learned._stop()
    model.zero_grad(set_to_none=True)
    t0 = time.perf_counter()
    with track(model, optimizer=opt, inputs=inputs):
        step()
    cold = time.perf_counter() - t0
    signatures = learned.cache_info()["learned"]
    model.zero_grad(set_to_none=True)
    t0 = time.perf_counter()
    with track(model, optimizer=opt, inputs=inputs):
        step()
    warm = time.perf_counter() - t0
    model.zero_grad(set_to_none=True)
    t0 = time.perf_counter()
    step()
    plain = time.perf_counter() - t0
    on_peak, prof_on, on_flags = _tracked(model, inputs, opt, step)
    os.environ["MEMKIT_LEARN_WORKSPACE"] = "0"
    try:
        off_peak, prof_off, off_flags = _tracked(model, inputs, opt, step)
    finally:
        del os.environ["MEMKIT_LEARN_WORKSPACE"]
    return {
        "case": f"{preset} ({size}) {str(dtype).removeprefix('torch.')}",
        "profiler peak": prof_on,
        "short, learning off": prof_off - off_peak,
        "flagged, learning off": len(off_flags),
        "short, learning on": prof_on - on_peak,
        "flagged, learning on": len(on_flags),
        "signatures learned": signatures,
        "plain (s)": plain,
        "tracked, cold (s)": cold,
        "tracked, warm (s)": warm,
        "cold / warm": cold / warm,
    }


def run(quick: bool = False) -> Section:
    rows = []
    with one_thread():
        for preset, size, dtype in CASES:
            if quick and size != "tiny":
                continue
            log(f"  {preset} ({size}) {dtype}")
            rows.append(_case(preset, size, dtype))
    exact = all(r["short, learning on"] == 0 and r["flagged, learning on"] == 0 for r in rows)
    notes = [
        f"CPU path: {cpu_path.cpu_path()}.",
        "Learning on: every case equals the profiler to the byte, nothing flagged."
        if exact
        else "Learning on: NOT exact in every case (see the table).",
        "'short, learning off' is what formulas alone miss on this CPU (0 where this path has formulas for every "
        "kernel met, e.g. fp32 attention; convolutions always need learning).",
        "cold: the first tracked step of the process (worker start, each signature learned once); warm: the next.",
    ]
    return Section(
        name="learned_workspace",
        title=TITLE,
        text=__doc__.split("\n", 1)[1],
        tables=[Table("Training step without optimizer (peak in the backward), CPU, 1 thread", rows)],
        notes=notes,
    )
