"""What the GPU tests share: a real step of a preset on CUDA, the libraries' first-use allocations made before any
window, and the CUDA part of a tracked timeline."""

from __future__ import annotations

import gc
import os

import numpy as np
import torch

import memkit

ALLOC_CONF = os.environ.get("PYTORCH_CUDA_ALLOC_CONF") or os.environ.get("PYTORCH_ALLOC_CONF") or ""
"""The caching allocator's settings in this process (torch reads them once, from the environment)."""


def settle() -> None:
    """Free what Python still holds and give the cached free segments back (``empty_cache``), so a window starts
    from the live blocks alone."""
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


def warm_up(preset: str) -> None:
    """One training step of ``preset``'s tiny model, thrown away, then :func:`settle`.

    cuBLAS allocates its workspace (32 MiB on sm90 and later, ``memkit/gpus.py``) through the caching allocator the
    first time a handle meets a stream: once for this thread (the forward, the optimizer) and once for autograd's
    device thread (the backward); cuDNN's convolutions make theirs on first use too. memkit's figures leave these
    out, so they are made here, before any window, and stay allocated (they are the floor a test measures from).
    """
    model = memkit.load_model(preset, size="tiny", dtype=torch.bfloat16, device="cuda")
    memkit.Step(optimizer="adamw").bind(model).run(memkit.make_inputs(model))
    del model
    settle()


def build(preset: str) -> tuple[torch.nn.Module, dict, memkit.step.StepRunner]:
    """``preset`` at size ``"small"`` on the GPU as ``memkit.estimate``'s default step has it: bf16 weights and
    inputs (batch 1, seed 0), AdamW (torch's default on CUDA: foreach)."""
    model = memkit.load_model(preset, size="small", dtype=torch.bfloat16, device="cuda")
    inputs = memkit.make_inputs(model)
    return model, inputs, memkit.Step(optimizer="adamw").bind(model)


def run_steps(runner: memkit.step.StepRunner, inputs: dict, n: int = 2) -> None:
    """``n`` training steps (two: the first, which makes the optimizer state, and the steady one), then wait for the
    device, so the allocator's counters are read after the last kernel."""
    for _ in range(n):
        runner.run(inputs)
    torch.cuda.synchronize()


def cuda_window(timeline: memkit.Timeline) -> tuple[int, int]:
    """(highest, last) bytes the CUDA events of ``timeline`` added to what was live when it began: what
    ``max_memory_allocated()`` and ``memory_allocated()`` rise by over the same window. Events on other devices are
    left out: a real step also makes CPU tensors (AdamW's step counters, unless ``capturable`` or ``fused``)."""
    if not len(timeline):
        return 0, 0
    on_cuda = np.array([d.startswith("cuda") for d in timeline.devices], dtype=bool)
    walk = np.cumsum(timeline.signed_bytes[on_cuda[timeline.column("device")]])
    if not len(walk):
        return 0, 0
    return max(0, int(walk.max())), int(walk[-1])
