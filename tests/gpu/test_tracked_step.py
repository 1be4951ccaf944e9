"""``memkit.track`` on a real CUDA training step: the bytes it sees allocated and freed are the caching allocator's,
to the byte (``torch.cuda.max_memory_allocated`` and ``memory_allocated`` over the same window).

Each storage the tracker sees is one block of the allocator, rounded up to 512 bytes (``alloc_granularity=512``).
What it cannot see is kept out of the window: cuBLAS's workspaces (made by :func:`warm_up` before it; they stay
allocated below the window's start) and buffers a kernel allocates inside itself, which no dispatch mode sees: the
step runs with the math attention backend, whose ops are all visible (flash attention's backward makes its
``softmax_d`` and ``dq_accum`` inside the kernel); Flux has no convolution (cuDNN's workspaces: inside the kernel).

``device="cuda"`` tells the tracker which device it measures (without it, CPU kernels' buffers, such as the Python
numbers an op wraps into CPU tensors, would be counted on the op's device); it then counts every storage it sees as
that device's. So the window makes CUDA tensors only: AdamW is ``capturable``, which keeps its step counters on the
device (torch's default keeps them on the CPU).
"""

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

import memkit

from ._cuda_run import cuda_window, settle, warm_up

PRESET = "flux"


def test_a_tracked_step_is_the_allocators_own_count(gpu_record):
    warm_up(PRESET)
    model = memkit.load_model(PRESET, size="small", dtype=torch.bfloat16, device="cuda")
    inputs = memkit.make_inputs(model)
    optimizer = torch.optim.AdamW(model.parameters(), foreach=True, capturable=True)
    settle()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    with sdpa_kernel(SDPBackend.MATH):
        with memkit.track(
            model, optimizer=optimizer, inputs=inputs, alloc_granularity=512, device="cuda", cuda_history=False
        ) as tl:
            for _ in range(2):  # the first step makes the optimizer state, the second carries it
                memkit.train_step(model, inputs, optimizer)
            torch.cuda.synchronize()
    real_peak = torch.cuda.max_memory_allocated() - before
    real_end = torch.cuda.memory_allocated() - before
    del model, inputs, optimizer
    peak, end = cuda_window(tl)
    gpu_record(PRESET, "tracked step, math attention, capturable AdamW (window)", allocated=(peak, real_peak))
    assert (peak, end) == (real_peak, real_end)
