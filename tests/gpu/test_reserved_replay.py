"""The caching-allocator model (``memkit.memory.CachingAllocator``) replaying a real step's own allocations and frees,
read from the allocator's history: it makes the segments the GPU made and ends with its reserved bytes, to the byte
(``torch.cuda.max_memory_reserved``; reserved bytes never fall without ``empty_cache`` or an out-of-memory retry,
so the peak is the end).

The window is the model's build and two training steps, from a cache emptied of free segments; what was allocated
before it (the cuBLAS workspaces :func:`warm_up` made) is laid out from the snapshot's segments by
:func:`memkit.memory.replay_trace`, the replay ``tests/test_caching_allocator_real.py`` holds against public
snapshots (and ``memkit inspect FILE --replay`` prints).
"""

import pytest
import torch

from memkit.memory import replay_trace

from ._cuda_run import ALLOC_CONF, build, run_steps, warm_up

PRESET = "flux"
MAX_ENTRIES = 2_000_000  # the trace is a ring buffer: a full one has lost the window's start


def test_the_allocator_model_replays_a_real_step_to_the_reserved_byte(gpu_record):
    if ALLOC_CONF:
        pytest.skip(f"the replay models torch's default allocator; this process runs with {ALLOC_CONF!r}")
    warm_up(PRESET)
    device = torch.cuda.current_device()
    history = torch.cuda.memory._record_memory_history
    history(enabled=None)  # stops any recording; every torch since 2.1 clears the trace then
    history(enabled="all", context=None, stacks="python", max_entries=MAX_ENTRIES)
    try:
        torch.cuda.reset_peak_memory_stats()
        model, inputs, runner = build(PRESET)
        run_steps(runner, inputs)
        snapshot = torch.cuda.memory._snapshot()
        real = {
            "allocated": torch.cuda.memory_allocated(),
            "reserved": torch.cuda.memory_reserved(),
            "max_reserved": torch.cuda.max_memory_reserved(),
        }
    finally:
        history(enabled=None)
    del model, inputs, runner
    trace = snapshot["device_traces"][device]
    assert 0 < len(trace) < MAX_ENTRIES
    replayed = replay_trace(snapshot, alloc_conf="")[device]
    assert replayed.reason is None, replayed.reason
    allocator = replayed.model
    gpu_record(
        PRESET,
        "allocator model on the step's own trace (build + 2 steps): allocated at the end, reserved peak",
        allocated=(allocator.allocated_bytes, real["allocated"]),
        reserved=(allocator.max_reserved_bytes, real["max_reserved"]),
    )
    assert replayed.same, [e for e in replayed.events if not e.same][:5]  # every segment the GPU made, alike
    assert allocator.max_reserved_bytes == real["max_reserved"]
    assert allocator.reserved_bytes == real["reserved"]
    assert allocator.allocated_bytes == real["allocated"]
