"""Full-size estimates of the fine-tuning recipes people run, each as a ratio to the full fine-tune's in the same run.

Full FLUX.1-dev (11.9B), bf16, ``device="cuda"``, first and steady step (the defaults): the full fine-tune with
AdamW, the same with AdamW on the CPU (torchao's ``CPUOffloadOptimizer``, ``optimizer_on="cpu"``: every block runs),
then LoRA (peft, rank 16, the diffusers script's default targets), + 8-bit AdamW (bitsandbytes), + checkpointing,
and DoRA. Each recipe is estimated twice in one process: the first call (its fake dispatch partly
learned by the recipes before it: the order below) and a repeat of the same call (the process's result cache).
``vs full`` is the full fine-tune's first-call seconds over the recipe's (above 1: faster). The peak is the one a
user reads (steady or first step, whichever is larger; allocated bytes); ``memoized`` says whether the probe of
four blocks per list was spliced (see ``memkit.estimate``'s ``memoize``); ``host`` is what the recipe keeps in CPU
memory, off the GPU peak (``meta["host_bytes"]``, summed).
"""

from __future__ import annotations

import time

import memkit

from . import Section, Table, log

TITLE = "recipes: full-size estimate time per fine-tuning recipe, as a ratio to the full fine-tune's"


def _recipes() -> dict[str, dict]:
    lora = memkit.LoRA(rank=16)
    return {
        "full fine-tune (adamw)": dict(optimizer="adamw"),
        "full fine-tune (adamw on the CPU)": dict(optimizer="adamw", optimizer_on="cpu"),
        "LoRA r16 (adamw)": dict(optimizer="adamw", optimizations=[lora]),
        "LoRA r16 + adamw8bit": dict(optimizer="adamw8bit", optimizations=[lora]),
        "LoRA r16 + adamw8bit + checkpointing": dict(
            optimizer="adamw8bit", optimizations=[lora, memkit.Checkpointing()]
        ),
        "DoRA r16 (adamw)": dict(optimizer="adamw", optimizations=[memkit.LoRA(rank=16, dora=True)]),
    }


def run(quick: bool) -> Section:
    size = "tiny" if quick else "full"
    rows, base = [], None
    memkit.estimate("flux", size="tiny", progress=False)  # imports and the first fake dispatch out of the timing
    for name, kwargs in _recipes().items():
        log(f"{name} ({size})")
        t0 = time.perf_counter()
        tl = memkit.estimate("flux", size=size, progress=False, **kwargs)
        first = time.perf_counter() - t0
        t0 = time.perf_counter()
        memkit.estimate("flux", size=size, progress=False, **kwargs)
        again = time.perf_counter() - t0
        base = first if base is None else base
        rows.append(
            {
                "recipe": name,
                "estimate (s)": first,
                "vs full": base / first,
                "again (s)": again,
                "peak (GiB)": tl.peak_bytes / 2**30,
                "host (GiB)": sum(tl.meta["host_bytes"].values()) / 2**30,
                "measured at": "steady" if tl.peak_bytes == tl.meta["steady_peak_bytes"] else "first",
                "trainable": f"{tl.meta['trainable_parameters']:,}",
                "memoized": tl.meta["memoized"],
            }
        )
    return Section(
        name="recipes",
        title=TITLE,
        text=__doc__,
        tables=[Table(f"Flux {size}, bf16, device cuda, allocated bytes", rows)],
        notes=["Seconds vary up to ~1.8x between runs on this 2-core VM; the ratios are within one run."],
    )
