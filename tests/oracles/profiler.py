"""The allocator's own numbers over a window, measured by ``torch.profiler`` independently of memkit's tracker."""

import gc

from torch._C._profiler import _EventType
from torch.profiler import ProfilerActivity, profile

from memkit.memory import track


def profiler_window(prof) -> tuple[int, int]:
    """(peak, end) of the CPU allocator's bytes over the profiled window, relative to its start."""
    events = []

    def walk(nodes):
        for n in nodes:
            if n.tag == _EventType.Allocation and n.extra_fields.device.type == "cpu":
                events.append((n.start_time_ns, n.extra_fields.alloc_size))
            walk(n.children)

    walk(prof.profiler.kineto_results.experimental_event_tree())
    events.sort(key=lambda e: e[0])
    live = peak = 0
    for _, size in events:
        live += size
        peak = max(peak, live)
    return peak, live


def assert_equals_profiler(tl, prof_peak, prof_end):
    """To the byte, with nothing flagged: on paths no formula models, the kernels' buffers are learned."""
    assert tl.meta["lower_bound_ops"] == []
    assert tl.peak_bytes - tl.baseline_bytes == prof_peak
    assert tl.end_bytes - tl.baseline_bytes == prof_end


def tracked_and_profiled(fn, **track_kwargs):
    gc.collect()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        with track(**track_kwargs) as tl:
            fn()
    return tl, profiler_window(prof)
