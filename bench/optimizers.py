"""One optimizer step of each optimizer memkit runs by name, on the CPU, as a ratio to AdamW's in the same run.

The small Flux preset (fp32 and bf16): one backward makes the gradients, then each optimizer steps on its own copy
of the model several times, interleaved round by round (first steps, which create the state, are left out); the
fastest round counts (as ``timeit``). ``vs adamw`` is AdamW's time over the optimizer's (above 1: faster). State is
the optimizer's ``optimizer.state`` storages after its steps, over the parameters' bytes; the update's peak is what
``memkit.track()`` sees allocated above the step's start during one steady step (state and temporaries). torch runs
on one thread (a shared 2-core machine). bitsandbytes' CPU kernels are Python (fp32 copies of the moments); on CUDA
they are fused kernels, so these CPU ratios say nothing about GPU speed.
"""

from __future__ import annotations

import copy
import time

import torch

import memkit
from memkit.optimizers import OPTIMIZERS, make_optimizer

from . import Section, Table, log, one_thread

TITLE = "optimizers: one CPU step of each optimizer by name, as a ratio to AdamW"


def _state_bytes(opt: torch.optim.Optimizer) -> int:
    seen = {}
    for state in opt.state.values():
        for v in state.values():
            if isinstance(v, torch.Tensor):
                seen[v.untyped_storage()._cdata] = v.untyped_storage().nbytes()
    return sum(seen.values())


def _rows(size: str, dtype: torch.dtype, rounds: int) -> list[dict]:
    base = memkit.load_model("flux", size=size, dtype=dtype)
    inputs = memkit.make_inputs(base)
    memkit.train_step(base, inputs)  # gradients, kept on every copy
    param_bytes = sum(p.numel() * p.element_size() for p in base.parameters())
    runs = {}
    for name in OPTIMIZERS:
        model = copy.deepcopy(base)  # deepcopy leaves .grad behind
        for p, q in zip(model.parameters(), base.parameters(), strict=True):
            p.grad = q.grad.clone()
        opt = make_optimizer(name, model.parameters())
        opt.step()  # the first step makes the state
        with memkit.track(model=model, optimizer=opt) as tl:
            opt.step()
        runs[name] = (opt, tl.peak_bytes - tl.baseline_bytes, [])
    for r in range(rounds):
        log(f"flux {size} {str(dtype).replace('torch.', '')}: round {r + 1}/{rounds}")
        for opt, _, times in runs.values():
            t0 = time.perf_counter()
            opt.step()
            times.append(time.perf_counter() - t0)
    adamw = min(runs["adamw"][2])
    return [
        {
            "optimizer": name,
            "step (ms)": 1e3 * min(times),
            "vs adamw": adamw / min(times),
            "state / parameter bytes": _state_bytes(opt) / param_bytes,
            "update peak (MiB)": peak / 2**20,
        }
        for name, (opt, peak, times) in runs.items()
    ]


def run(quick: bool) -> Section:
    size, rounds = ("tiny", 3) if quick else ("small", 7)
    tables = []
    with one_thread():
        for dtype in (torch.float32, torch.bfloat16):
            model = memkit.load_model("flux", size=size, dtype=dtype)
            n = sum(p.numel() for p in model.parameters())
            del model
            caption = f"Flux {size} ({n / 1e6:.1f}M parameters), {str(dtype).replace('torch.', '')}, one thread"
            tables.append(Table(caption, _rows(size, dtype, rounds)))
    return Section(
        name="optimizers",
        title=TITLE,
        text=__doc__,
        tables=tables,
        notes=[
            "State ratios are exact (the tests hold them to the byte); timings are the fastest of the rounds.",
            "paged-adamw8bit on the CPU is adamw8bit (bitsandbytes does not page CPU tensors).",
        ],
    )
