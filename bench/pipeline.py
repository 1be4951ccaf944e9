"""Whole-job estimates (``memkit.estimate_job``), each as a ratio to the step's own estimate in the same run.

Full FLUX.1-dev, LoRA rank 16 + checkpointing, bf16 AdamW, ``device="cuda"``, first and steady step. The step
(``memkit.estimate``) is timed first; each job after it reuses that estimate (the process's result cache) and adds
its phases: the components' runs on fake tensors (T5-XXL, CLIP-L, the VAE; each run once per process and setting),
the composition, and one caching-allocator replay through the phases. ``job / step`` is the job's seconds over the
step's (what a pipeline costs on top of the step, in the same process); ``again`` repeats the job (components cached).
The figures are each job's peak reserved bytes and the phase that sets it; ``host`` the most host memory a phase
holds. The quantized row times its own step (memoized) and its job quantizes on the GPU (the real library on the
full fake model, tracked, every time: not cached).
"""

from __future__ import annotations

import time

import memkit

from . import Section, Table, log

TITLE = "pipeline: whole-job estimates (components, phases) as a ratio to the step's estimate"


def _jobs(quick: bool) -> dict[str, tuple]:
    lora = [memkit.LoRA(rank=16), memkit.Checkpointing()]
    jobs = {
        "transformer alone (default)": (memkit.Pipeline(), lora),
        "text encoders + VAE on the GPU": (memkit.Pipeline(text_encoders="gpu", vae="gpu"), lora),
        "text encoders on the CPU": (memkit.Pipeline(text_encoders="cpu"), lora),
        "precompute + validate 100:28": (memkit.Pipeline(precompute=True, validate=(100, 28)), lora),
    }
    if not quick:
        jobs["nf4, quantized on the GPU"] = (
            memkit.Pipeline(quantize_on="gpu"), [memkit.Quantize(method="nf4"), *lora]
        )  # fmt: skip
    return jobs


def run(quick: bool) -> Section:
    size = "tiny" if quick else "full"
    memkit.estimate("flux", size="tiny", progress=False)  # imports and the first fake dispatch out of the timing
    rows = []
    steps: dict[tuple, float] = {}
    for name, (pipeline, optimizations) in _jobs(quick).items():
        log(f"{name} ({size})")
        key = tuple(str(o) for o in optimizations)
        if key not in steps:
            t0 = time.perf_counter()
            memkit.estimate("flux", size=size, optimizations=optimizations, progress=False)
            steps[key] = time.perf_counter() - t0
        t0 = time.perf_counter()
        job = memkit.estimate_job("flux", pipeline, size=size, optimizations=optimizations, progress=False)
        seconds = time.perf_counter() - t0
        t0 = time.perf_counter()
        memkit.estimate_job("flux", pipeline, size=size, optimizations=optimizations, progress=False)
        again = time.perf_counter() - t0
        rows.append(
            {
                "job": name,
                "step (s)": steps[key],
                "job (s)": seconds,
                "job / step": seconds / steps[key],
                "again (s)": again,
                "peak reserved (GiB)": job.peak_reserved_bytes / 2**30,
                "in": job.peak_phase,
                "host (GiB)": job.host_peak_bytes / 2**30,
            }
        )
    return Section(
        name="pipeline",
        title=TITLE,
        text=__doc__,
        tables=[Table(f"Flux {size}, LoRA r16 + checkpointing, bf16 AdamW, device cuda", rows)],
        notes=["Seconds vary up to ~1.8x between runs on this 2-core VM; the ratios are within one run."],
    )
