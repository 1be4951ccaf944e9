"""Every preset's estimate at size ``"small"`` for ``device="cuda"`` (a bf16 AdamW step, first and steady) held
against the same two steps run on the GPU: the allocated peak (``max_memory_allocated``) and the reserved peak
(``max_memory_reserved``), each measured from the floor the cuBLAS workspaces set (:func:`warm_up`), which the
estimate leaves out.

Not to the byte, because an estimate runs CPU kernels on fake tensors and a GPU runs its own:

- attention: the estimate takes the CPU's backend and its outputs; the GPU picks flash, memory-efficient or cuDNN
  attention, with other auxiliary outputs (log-sum-exp layouts, RNG state) and buffers made inside the kernel
  (flash attention's backward: ``softmax_d``, ``dq_accum``) that no tracker sees;
- cuDNN's convolution workspaces (UNets, patch embeddings, video VAEs' 3D convolutions) are inside the kernel too;
- AdamW's step counters (4 bytes a parameter) are CPU tensors on a GPU (not ``capturable``, not ``fused``); the
  estimate counts each as a 512-byte device block;
- reserved bytes also follow where each block lands: the real model is built on the device among its
  initialisers' temporaries (the segments they leave are emptied before the steps), the estimate's replay lays the
  weights out fresh.

The tolerances are first guesses, to be narrowed once ``bench/GPU.md`` holds a run's figures.
"""

import pytest
import torch

import memkit

from ._cuda_run import ALLOC_CONF, build, run_steps, settle, warm_up

ALLOCATED_TOLERANCE = 0.05
RESERVED_TOLERANCE = 0.10


@pytest.mark.parametrize("preset", sorted(memkit.PRESETS))
def test_a_small_estimate_is_near_the_real_step(preset, gpu_record):
    estimate = memkit.estimate(preset, size="small", device="cuda", alloc_conf=ALLOC_CONF, progress=False)
    warm_up(preset)
    floor_allocated, floor_reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    model, inputs, runner = build(preset)
    settle()  # the initialisers' cached segments given back: the estimate's replay starts from the weights alone
    torch.cuda.reset_peak_memory_stats()
    run_steps(runner, inputs)
    allocated = torch.cuda.max_memory_allocated() - floor_allocated
    reserved = torch.cuda.max_memory_reserved() - floor_reserved
    del model, inputs, runner
    gpu_record(
        preset,
        "estimate (first and steady step)",
        allocated=(estimate.peak_bytes, allocated),
        reserved=(estimate.peak_reserved_bytes, reserved),
    )
    assert estimate.peak_bytes == pytest.approx(allocated, rel=ALLOCATED_TOLERANCE)
    assert estimate.peak_reserved_bytes == pytest.approx(reserved, rel=RESERVED_TOLERANCE)
