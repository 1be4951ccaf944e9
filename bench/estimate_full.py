"""What ``memkit.estimate`` costs at full size: seconds and RAM per preset, and the peaks it predicts.

Each estimate (a bf16 AdamW training step planned for CUDA, default input sizes, ``memkit.estimate``'s default:
the first and the steady step, both measured, the peak being the larger) runs in a fresh Python process,
so its peak RSS (``VmHWM``) is its own: "RSS after imports" is the floor that importing torch,
diffusers and memkit sets, "peak RSS" includes the estimate. The estimate's seconds are the ones it reports in
``timeline.meta`` (model construction on fake tensors, the step, the timeline); "process" adds interpreter start
and imports. The same is run again with ``Checkpointing(pattern="all")``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

from . import Section, Table, log

TITLE = "estimate_full: memkit.estimate() of full-size training steps"
TARGET_SECONDS, TARGET_RSS_GIB = 30.0, 1.5  # full Flux
_TIMEOUT = 1800


def _peak_rss_kib() -> int:
    """This process's peak RSS in KiB. ``VmHWM`` belongs to the process's own memory map; ``ru_maxrss`` is not
    used on Linux because exec carries the parent's high-water mark over into the child."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1])
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def _worker(preset: str, checkpointing: bool) -> None:
    import torch

    import memkit

    rss_imports = _peak_rss_kib()
    optimizations = [memkit.Checkpointing(pattern="all")] if checkpointing else []
    timeline = memkit.estimate(
        preset,
        size="full",
        mode="training",
        dtype=torch.bfloat16,
        optimizer="adamw",
        device="cuda",
        optimizations=optimizations,
    )
    result = {
        "seconds": timeline.meta["seconds"],
        "parameters": timeline.meta["parameters"],
        "events": len(timeline),
        "peak_bytes": timeline.peak_bytes,
        "first_step_peak_bytes": timeline.meta["first_step_peak_bytes"],
        "steady_peak_bytes": timeline.meta["steady_peak_bytes"],
        "peak_by_category": timeline.peak_by_category(),
        "max_activation_bytes": int(timeline.live_by_category()["activation"].max(initial=0)),
        "peak_phase": _phase_at(timeline, timeline.peak_index),
        "rss_imports_kib": rss_imports,
        "rss_peak_kib": _peak_rss_kib(),
    }
    print(json.dumps(result), flush=True)


def _phase_at(timeline, index: int) -> str:
    from memkit.memory.events import PHASES

    return PHASES[timeline.column("phase")[index]] if index >= 0 else "-"


def _estimate(preset: str, checkpointing: bool) -> dict:
    cmd = [sys.executable, "-m", "bench.estimate_full", preset] + (["--checkpointing"] if checkpointing else [])
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    t0 = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=_TIMEOUT, cwd=root)
    wall = time.perf_counter() - t0
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[2:])} exited {done.returncode}: {done.stderr.strip()[-600:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    result["process_seconds"] = wall
    return result


def run(quick: bool = False) -> Section:
    import memkit

    presets = ("dit", "pixart") if quick else tuple(memkit.PRESETS)
    rows, notes, flux = [], [], {}
    for preset in presets:
        row: dict = {"preset": preset}
        for checkpointing in (False, True):
            label = "checkpointing" if checkpointing else "baseline"
            log(f"  {preset} ({label}): estimating in a fresh process")
            try:
                r = _estimate(preset, checkpointing)
            except (RuntimeError, subprocess.TimeoutExpired, ValueError) as e:
                log(f"  {preset} ({label}) FAILED: {e}")
                row[f"{label} error"] = str(e).splitlines()[-1][:200]
                continue
            log(f"  {preset} ({label}): {r['seconds']:.1f} s, peak RSS {r['rss_peak_kib'] / 2**10:.0f} MiB")
            if checkpointing:
                row["peak ckpt (GiB)"] = r["peak_bytes"] / 2**30
                row["first step ckpt (GiB)"] = r["first_step_peak_bytes"] / 2**30
                row["steady step ckpt (GiB)"] = r["steady_peak_bytes"] / 2**30
                row["estimate ckpt (s)"] = r["seconds"]
                row["peak RSS ckpt (MiB)"] = r["rss_peak_kib"] / 2**10
                row["max activation ckpt (GiB)"] = r["max_activation_bytes"] / 2**30
            else:
                row.update(
                    {
                        "parameters (B)": r["parameters"] / 1e9,
                        "events": r["events"],
                        "estimate (s)": r["seconds"],
                        "process (s)": r["process_seconds"],
                        "RSS after imports (MiB)": r["rss_imports_kib"] / 2**10,
                        "peak RSS (MiB)": r["rss_peak_kib"] / 2**10,
                        "peak (GiB)": r["peak_bytes"] / 2**30,
                        "first step (GiB)": r["first_step_peak_bytes"] / 2**30,
                        "steady step (GiB)": r["steady_peak_bytes"] / 2**30,
                        "max activation (GiB)": r["max_activation_bytes"] / 2**30,
                        "peak is in": r["peak_phase"],
                    }
                )
                if preset == "flux":
                    flux = r
        if "peak (GiB)" in row and "peak ckpt (GiB)" in row:
            row["ckpt / baseline peak"] = row["peak ckpt (GiB)"] / row["peak (GiB)"]
        rows.append(row)
    if flux:
        seconds, rss = flux["seconds"], flux["rss_peak_kib"] / 2**20
        ok_time, ok_rss = seconds <= TARGET_SECONDS, rss <= TARGET_RSS_GIB
        notes.append(
            f"Target, full Flux: ≤ {TARGET_SECONDS:.0f} s and ≤ {TARGET_RSS_GIB} GiB RSS. Measured {seconds:.1f} s "
            f"({'met' if ok_time else 'MISSED'}) and {rss:.2f} GiB peak RSS ({'met' if ok_rss else 'MISSED'})."
        )
    notes += [
        "Which step: every peak is allocated bytes on the planned GPU; 'peak' is the larger of the first step's "
        "and the steady step's (step 2, which every later step repeats: the optimizer state exists through its "
        "forward and backward), each also given. Before the steady-state default (2026-11-25) this table held "
        "first-step peaks, and an estimate ran one step: it now runs two, so it takes about twice as long.",
        "With AdamW the peak of most presets falls in the optimizer step (parameters, gradients, two moments "
        "and a foreach temporary), where checkpointing cannot help; its effect shows in the max activation "
        "columns, and on the peak of a step without optimizer (`memkit estimate PRESET --optimizer none`).",
        "Peaks are what torch.cuda.max_memory_allocated() would report (512-byte blocks); nvidia-smi adds the CUDA "
        "context, library workspaces and fragmentation.",
        "The estimates run one after another; the machine's other load slows them (see the load average above).",
    ]
    return Section(
        name="estimate_full",
        title=TITLE,
        text=__doc__.split("\n", 1)[1],
        tables=[Table("bf16 parameters, AdamW, device='cuda', batch 1, the preset's full-size inputs", rows)],
        notes=notes,
    )


if __name__ == "__main__":
    _worker(sys.argv[1], "--checkpointing" in sys.argv[2:])
