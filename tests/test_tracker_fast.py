"""The tracker (``memkit/memory/tracker.py``) on small synthetic tensors and modules, in a few seconds: what the
Timeline records (events, categories, phases, the baseline), when storages die, and the few byte-exact checks
against the profiler (``tracked_and_profiled`` from ``tests/oracles``) on tiny steps.

Fast enough to run against every mutant (``python -m bench.mutation tracker``). Expected values come from the
tensors' own sizes or from the profiler, never from a previous run's output.
"""

import time

import numpy as np
import pytest
import torch
from oracles import assert_equals_profiler, tracked_and_profiled
from torch import nn
from torch.profiler import ProfilerActivity, profile
from torch.utils._python_dispatch import _get_current_dispatch_mode

import memkit.memory.recording as recording_module
import memkit.memory.tracker as tracker_module
from memkit.memory import CATEGORIES, PHASES, Timeline, off_device, phase, released, tag, track, tracking
from memkit.memory.events import ALLOC, FREE
from memkit.memory.tracker import Tracker
from memkit.memory.workspace import cpu_path as cp

RNG_BYTES = torch.get_rng_state().untyped_storage().nbytes()


# The profiler's first session in a process costs seconds: paid once here, at import (mutation testing forks each
# mutant's test run from a process that imported this file).
with profile(activities=[ProfilerActivity.CPU], profile_memory=True):
    torch.ones(1)


def nbytes(*tensors) -> int:
    """Bytes of the distinct storages behind ``tensors``."""
    return sum({t.untyped_storage()._cdata: t.untyped_storage().nbytes() for t in tensors}.values())


def events(tl) -> list[dict]:
    """Every event as a dict of readable values."""
    names = ("time", "action", "bytes", "category", "phase", "device", "op", "frame", "storage")
    cols = {n: tl.column(n).tolist() for n in names}
    out = []
    for i in range(len(tl)):
        r = {n: cols[n][i] for n in names} | {"index": i}
        r["category"], r["phase"] = CATEGORIES[r["category"]], PHASES[r["phase"]]
        r["device"] = tl.devices[r["device"]]
        r["op"] = tl.ops[r["op"]] if r["op"] >= 0 else None
        r["frame"] = tl.frames[r["frame"]] if r["frame"] >= 0 else None
        out.append(r)
    return out


def key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


def alloc_of(tl, t: torch.Tensor) -> dict:
    rows = [r for r in events(tl) if r["storage"] == key(t) and r["action"] == ALLOC]
    assert rows, "not allocated in the window"
    return rows[-1]


def free_of(tl, alloc: dict) -> dict | None:
    """The free of the allocation ``alloc`` (the first free of its storage key after it: keys are addresses,
    which the allocator reuses)."""
    ev = events(tl)[alloc["index"] + 1 :]
    return next((r for r in ev if r["storage"] == alloc["storage"] and r["action"] == FREE), None)


def _path(**kw) -> cp.CpuPath:
    return cp.CpuPath(**{"x86": True, "aten_capability": "AVX2", "onednn_isa": "AVX2", "amx": False, **kw})


class Keeper(nn.Module):
    """Allocates a kept tensor first thing in its forward (the window's event 0), then a Linear."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 3)
        self.kept = None

    def forward(self, x):
        self.kept = torch.ones(10)
        return self.lin(x)


# ---- allocations and frees ---------------------------------------------------------------------------------------


def test_an_allocation_and_its_free_when_the_storage_dies():
    with track() as tl:
        a = torch.empty(100)
        view = a[10:]
        storage = key(a)
        del a
        assert len(tl) == 1  # the view keeps the storage alive
        del view
        b = torch.zeros(0)  # no bytes: no event
    ev = events(tl)
    assert [(r["action"], r["bytes"], r["storage"]) for r in ev] == [(ALLOC, 400, storage), (FREE, 400, storage)]
    assert ev[0]["op"] == "aten.empty.memory_format" and ev[1]["op"] is None
    assert ev[0]["category"] == ev[1]["category"] == "temporary"
    assert ev[0]["phase"] == ev[1]["phase"] == "other"
    assert ev[0]["device"] == "cpu" and ev[0]["frame"] is None
    assert tl.meta["source"] == "tracker" and tl.meta["label"] is None and tl.meta["lower_bound_ops"] == []
    del b


def test_views_and_in_place_ops_allocate_nothing_but_torch_tensor_does():
    x = torch.randn(64)
    with track(inputs=x) as tl:
        v = x.view(8, 8).t()[1:3]
        x.add_(1.0)
        t = torch.tensor([1.0, 2.0, 3.0])  # built outside dispatch, handed in through lift_fresh
    ev = [r for r in events(tl) if r["storage"] != -1]
    assert [(r["action"], r["bytes"], r["storage"]) for r in ev] == [(ALLOC, 12, key(t))]
    assert ev[0]["op"] == "aten.lift_fresh.default"
    del v


def test_every_output_of_a_multi_output_op_is_recorded():
    x = torch.randn(10)
    with track(inputs=x) as tl:
        values, indices = torch.sort(x)  # a tuple: float and int64
        parts = torch._foreach_add([x, x], 1.0)  # a list
    born = {r["storage"]: r["bytes"] for r in events(tl) if r["action"] == ALLOC and r["storage"] != -1}
    assert born == {key(values): 40, key(indices): 80, key(parts[0]): 40, key(parts[1]): 40}


def test_outputs_nested_in_lists_inside_a_tuple_are_recorded_and_match_the_profiler():
    # The functional fused Adam returns a tuple of lists: (params, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps).
    def adam():
        return torch.ops.aten._fused_adam.default(
            [p],
            [g],
            [m],
            [v],
            [],
            [s],
            lr=1e-3,
            beta1=0.9,
            beta2=0.999,
            weight_decay=0.0,
            eps=1e-8,
            amsgrad=False,
            maximize=False,
        )

    p, g, m, v, s = torch.randn(1000), torch.randn(1000), torch.zeros(1000), torch.zeros(1000), torch.tensor(1.0)
    with track() as tl:
        out = adam()
    born = {r["storage"] for r in events(tl) if r["action"] == ALLOC and r["storage"] != -1}
    assert {key(t) for group in out for t in group} <= born
    del out
    tl, (prof_peak, prof_end) = tracked_and_profiled(adam)
    assert_equals_profiler(tl, prof_peak, prof_end)


def test_current_timeline_is_the_innermost_running_block_and_grows_live():
    from memkit.memory import current_timeline

    assert current_timeline() is None
    with track() as outer:
        assert current_timeline() is outer
        with track() as inner:
            assert current_timeline() is inner
            before = current_timeline().peak_bytes
            x = torch.ones(1000)
            assert current_timeline().peak_bytes >= before + x.nbytes
        assert current_timeline() is outer
    assert current_timeline() is None


def test_a_storage_seen_twice_is_counted_once():
    x = torch.randn(8)
    with track(inputs=x) as tl:
        y = torch.ones(8)
        torch.add(x, 1.0, out=y)  # writes into y's storage: aliasing, no new storage
        z = y.clone()
    assert [r["storage"] for r in events(tl) if r["action"] == ALLOC and r["storage"] != -1] == [key(y), key(z)]


def test_frees_after_the_block_are_not_recorded_and_the_timeline_is_fixed():
    with track(label="run 1") as tl:
        a = torch.empty(16)
    n = len(tl)
    del a
    torch.empty(8)
    assert len(tl) == n == 1 and tl.meta["label"] == "run 1"
    assert tl.end_bytes - tl.baseline_bytes == 64


def test_time_is_counted_from_start():
    tracker = Tracker()
    time.sleep(0.2)  # the clock restarts at start(), not at construction
    tracker.start()
    try:
        a = torch.empty(4)
    finally:
        tracker.stop()
    t = tracker.timeline.column("time")
    assert 0 <= t[0] < 0.15
    del a


def test_alloc_granularity_rounds_every_size():
    x = torch.randn(3, requires_grad=True)  # 12 bytes
    with track(inputs=x, alloc_granularity=512) as tl:
        a = torch.empty(1)  # 4 -> 512
        b = torch.empty(129)  # 516 -> 1024
        y = x / 2.0  # the saved divisor: 8 -> 512
        q = torch.randn(1, 1, 8, 4)
        torch.nn.functional.scaled_dot_product_attention(q, q, q)
    assert tl.baseline_by_category["input"] == 512
    ev = events(tl)
    assert alloc_of(tl, a)["bytes"] == 512 and alloc_of(tl, b)["bytes"] == 1024
    assert all(r["bytes"] % 512 == 0 and r["bytes"] > 0 for r in ev)
    saved = [r for r in ev if r["storage"] < -1]
    assert [r["bytes"] for r in saved] == [512]
    internal = [r for r in ev if r["storage"] == -1]
    assert internal and all(r["bytes"] % 512 == 0 for r in internal)
    del y


def test_record_stacks_interns_the_callers_lines():
    def make():
        return torch.empty(4)

    with track(record_stacks=True) as tl:
        a = make()
        q = torch.randn(1, 1, 8, 4)
        torch.nn.functional.scaled_dot_product_attention(q, q, q)
    frame = alloc_of(tl, a)["frame"]
    lines = frame.split("\n")
    assert len(lines) == 8  # the innermost 8 frames outside torch and memkit
    mine = [ln for ln in lines if "/mutmut/" not in ln]  # (mutation testing adds its trampolines' frames)
    assert mine[-1].endswith(" make") and "test_tracker_fast.py:" in mine[-1]
    assert mine[-2].endswith(" test_record_stacks_interns_the_callers_lines")
    assert not any("/torch/" in ln or "/memkit/memory/" in ln for ln in lines)
    internal = [r for r in events(tl) if r["storage"] == -1]
    for r in internal:
        assert [ln for ln in r["frame"].split("\n") if "/mutmut/" not in ln][-1].endswith("callers_lines")
    assert len(internal) == 2
    del a


def test_a_device_name_overrides_the_tensors_and_drops_cpu_only_buffers():
    x = torch.randn(16, requires_grad=True)
    with track(inputs=x, device="cuda:0") as tl:
        y = x / 2.0
        q = torch.randn(1, 1, 8, 4)
        torch.nn.functional.scaled_dot_product_attention(q, q, q)
    assert tl.devices == ["cuda:0"]
    ev = events(tl)
    assert all(r["device"] == "cuda:0" for r in ev)
    assert not [r for r in ev if r["storage"] < 0]  # no CPU kernel buffers, no CPU wrapped numbers
    del y


# ---- kernel-internal buffers and wrapped numbers -----------------------------------------------------------------


def test_kernel_buffers_are_an_alloc_and_free_of_temporary_after_the_outputs():
    q = torch.randn(1, 2, 16, 8)
    with track(inputs=[q]) as tl:
        out = torch.nn.functional.scaled_dot_product_attention(q, q, q)
    ev = events(tl)
    internal = [i for i, r in enumerate(ev) if r["storage"] == -1]
    assert len(internal) == 2
    a, f = ev[internal[0]], ev[internal[1]]
    assert (a["action"], f["action"]) == (ALLOC, FREE) and a["bytes"] == f["bytes"] > 0
    assert a["category"] == f["category"] == "temporary" and a["device"] == "cpu"
    assert a["op"] == f["op"] == "aten._scaled_dot_product_flash_attention_for_cpu.default"
    assert internal[0] > [i for i, r in enumerate(ev) if r["storage"] == key(out)][0]  # after the outputs
    del out


def test_a_saved_divisor_is_live_until_backward_releases_it():
    x = torch.randn(100, requires_grad=True)
    with track(inputs=x) as tl:
        y = x / 2.0
        z = x * 3.0
        (y.sum() + z.sum()).backward()
    saved = [r for r in events(tl) if r["storage"] < -1]
    assert [r["storage"] for r in saved if r["action"] == ALLOC] == [-2, -3]  # own keys, -2, -3, ...
    assert [(r["action"], r["bytes"], r["phase"]) for r in saved] == [(ALLOC, 8, "other")] * 2 + [
        (FREE, 8, "backward")
    ] * 2  # float64 numbers, freed when backward runs their nodes
    assert {r["storage"] for r in saved if r["action"] == FREE} == {-2, -3}
    assert all(r["category"] == "temporary" and r["op"] in ("aten.div.Tensor", "aten.mul.Tensor", None) for r in saved)


def test_a_divisor_not_saved_dies_when_the_op_returns():
    x = torch.randn(100, requires_grad=True)
    with track(inputs=x) as tl:
        with torch.no_grad():
            a = x / 2.0  # no graph: nothing saved, nothing expected
        b = x / 4.0
        del b  # the node and its divisor die with the output before the next op
        torch.empty(1)
    saved = [r for r in events(tl) if r["storage"] < -1]
    assert [(r["action"], r["bytes"], r["op"]) for r in saved] == [(ALLOC, 8, "aten.div.Tensor"), (FREE, 8, None)]
    assert tl.end_bytes - tl.baseline_bytes == nbytes(a)  # the empty(1) died at once too
    del a


def test_a_divisor_saved_by_the_last_op_is_resolved_at_stop():
    x = torch.randn(100, requires_grad=True)
    with track(inputs=x) as tl:
        y = x / 2.0
    assert tl.end_bytes - tl.baseline_bytes == nbytes(y) + 8  # y and the divisor its node keeps
    assert [r["action"] for r in events(tl) if r["storage"] < -1] == [ALLOC]
    del y


def test_a_step_with_saved_numbers_checkpointing_and_adamw_equals_the_profiler():
    torch.manual_seed(0)
    torch.set_num_threads(1)
    net = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))
    x = torch.randn(3, 8)
    opt = torch.optim.AdamW(net.parameters())

    def step():
        h = torch.utils.checkpoint.checkpoint(net, x, use_reentrant=False)
        loss = ((h / 2.0) * 3.0).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()
    tl, (peak, end) = tracked_and_profiled(step, model=net, optimizer=opt, inputs=[x])
    assert_equals_profiler(tl, peak, end)
    # checkpoint() keeps one RNG state from the forward to the backward, and forks one to recompute
    states = [r for r in events(tl) if r["op"] == "torch.get_rng_state" and r["action"] == ALLOC]
    assert [(r["bytes"], r["phase"], r["category"]) for r in states] == [
        (RNG_BYTES, "other", "temporary"),
        (RNG_BYTES, "backward", "temporary"),
    ]


def test_backward_of_a_saved_divisor_equals_the_profiler():
    torch.set_num_threads(1)
    x = torch.randn(1000, requires_grad=True)
    kept = {}

    def step():
        y = x / 2.0
        kept["y"] = y
        y.sum().backward()

    tl, (peak, end) = tracked_and_profiled(step, inputs=[x])
    assert_equals_profiler(tl, peak, end)
    x.grad = None


# ---- phases -----------------------------------------------------------------------------------------------------


def test_phases_forward_backward_optimizer_other_and_explicit():
    w = nn.Parameter(torch.randn(4))
    b = nn.Parameter(torch.randn(4))
    opt = torch.optim.AdamW([w, b], foreach=False)

    class Scale(nn.Module):
        def forward(self, x):
            return x * w + b

    m = Scale()
    x = torch.randn(4)
    with track(m, optimizer=opt, inputs=x) as tl:
        o = torch.empty(2)
        y = m(x)
        loss = y.pow(2).sum()
        loss.backward()
        opt.step()
        with phase("ema"):
            e = torch.empty(3)
            y2 = m(x)  # explicit wins over forward
        after = torch.empty(5)
    assert alloc_of(tl, o)["phase"] == "other"
    assert alloc_of(tl, y)["phase"] == "forward"
    assert alloc_of(tl, loss)["phase"] == "other"
    assert alloc_of(tl, w.grad)["phase"] == "backward"
    assert alloc_of(tl, opt.state[w]["exp_avg"])["phase"] == "optimizer"
    assert alloc_of(tl, e)["phase"] == "ema" and alloc_of(tl, y2)["phase"] == "ema"
    assert alloc_of(tl, after)["phase"] == "other"
    del o, e, after


def test_explicit_phase_wins_over_backward_and_backward_over_optimizer_and_optimizer_over_forward():
    w = nn.Parameter(torch.randn(4))
    x = torch.randn(4)
    opt = torch.optim.SGD([w], lr=0.1)
    got = {}

    def closure():
        got["in_step"] = torch.empty(6)
        loss = (w * x).sum()
        loss.backward()  # backward inside the optimizer step
        return loss

    class StepInForward(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = w

        def forward(self):
            opt.step(closure)
            got["after_step"] = torch.empty(7)

    with track(inputs=x) as tl:
        StepInForward()()
        loss = (w * x).sum()
        with phase("ema"):
            loss.backward()  # the explicit phase wins over backward
    assert alloc_of(tl, got["in_step"])["phase"] == "optimizer"
    grads = [r for r in events(tl) if r["category"] == "gradient" and r["action"] == ALLOC]
    assert [r["phase"] for r in grads] == ["backward"]
    assert alloc_of(tl, got["after_step"])["phase"] == "forward"
    ema = [r for r in events(tl) if r["phase"] == "ema" and r["action"] == ALLOC]
    assert ema and all(r["category"] == "temporary" for r in ema)  # no backward start: no retag


def test_a_free_is_recorded_in_the_phase_running_when_the_storage_dies():
    x = torch.randn(4)
    with track(inputs=x) as tl:
        a = torch.empty(10)
        b = torch.empty(11)
        with phase("ema"):
            del a
        c = torch.empty(12)
        with phase("optimizer"):
            d = torch.empty(13)
        del b, c
    ev = events(tl)
    frees = [(r["bytes"], r["phase"]) for r in ev if r["action"] == FREE]
    assert (40, "ema") in frees
    assert (44, "optimizer") in frees  # no explicit phase: the last phase any op ran in
    del d


def test_hooks_started_inside_a_forward_or_a_step_do_not_leave_a_phase_behind():
    t = Tracker()

    class Starts(nn.Module):
        def forward(self, x):
            t.start()
            return x

    opt = torch.optim.SGD([nn.Parameter(torch.randn(2))], lr=0.1)
    try:
        Starts()(torch.ones(1))  # its forward post hook runs without a pre hook
        a = torch.empty(3)
    finally:
        t.stop()
    assert alloc_of(t.timeline, a)["phase"] == "other"
    t2 = Tracker()

    def closure():
        t2.start()

    try:
        opt.step(closure)  # the step's post hook runs without a pre hook
        b = torch.empty(3)
    finally:
        t2.stop()
    assert alloc_of(t2.timeline, b)["phase"] == "other"


# ---- categories -------------------------------------------------------------------------------------------------


def test_forward_allocations_alive_at_backward_are_activation_the_rest_temporary():
    m = Keeper()
    x = torch.randn(2, 4)
    with track(m, inputs=x) as tl:
        y = m(x)
        with phase("forward"):
            scratch = torch.empty(5)
            del scratch
            tagged = torch.empty(6)
            tag(tagged, "ema")
        outside = torch.empty(7)
        seen_before_backward = tl.peak_by_category()["activation"]
        y.sum().backward()
    ev = events(tl)
    assert ev[0]["storage"] == key(m.kept)  # the first event of the window...
    assert ev[0]["category"] == "activation"  # ...is retagged too
    assert alloc_of(tl, y)["category"] == "activation"
    assert [r["category"] for r in ev if r["bytes"] == 20] == ["temporary", "temporary"]  # died in forward
    assert alloc_of(tl, tagged)["category"] == "ema"
    assert alloc_of(tl, outside)["category"] == "temporary"  # not born in the forward phase
    assert seen_before_backward == 0 and tl.peak_by_category()["activation"] >= nbytes(m.kept, y)
    assert tl.baseline_by_category["input"] == nbytes(x)  # a pre-window storage is never an activation


def test_recompute_in_backward_under_checkpointing_is_activation():
    lin = nn.Sequential(nn.Linear(4, 4), nn.GELU())  # gelu saves the addmm's output: it is recomputed
    x = torch.randn(2, 4, requires_grad=True)

    class Block(nn.Module):
        def forward(self, x):
            return torch.utils.checkpoint.checkpoint(lin, x, use_reentrant=False)

    with track(inputs=x) as tl:
        Block()(x).sum().backward()
    ev = events(tl)
    recomputed = [r for r in ev if r["phase"] == "backward" and r["op"] == "aten.addmm.default"]
    assert recomputed and {r["category"] for r in recomputed} == {"activation"}
    grads = [r for r in ev if r["phase"] == "backward" and r["op"] != "aten.addmm.default" and r["action"] == ALLOC]
    assert "activation" not in {r["category"] for r in grads}
    states = [r for r in ev if r["op"] == "torch.get_rng_state"]
    # the state saved in the forward is alive at backward; the one forked to recompute is born outside a module
    assert [(r["bytes"], r["phase"], r["category"]) for r in states if r["action"] == ALLOC] == [
        (RNG_BYTES, "forward", "activation"),
        (RNG_BYTES, "backward", "temporary"),
    ]
    assert [free_of(tl, r)["phase"] for r in states] == ["backward", "backward"]


def test_rng_state_in_backward_under_a_forward_hook_is_activation_and_the_function_is_restored():
    real = torch.get_rng_state
    x = torch.randn(3, requires_grad=True)
    got = {}

    class Saves(nn.Module):
        def forward(self):
            got["state"] = torch.get_rng_state()

    def hook(grad):
        Saves()()
        got["plain"] = torch.get_rng_state()
        return grad

    with track(inputs=x) as outer:
        assert torch.get_rng_state is not real
        with track() as inner:
            s = torch.get_rng_state()
        assert torch.get_rng_state is not real  # the outer tracker still needs it
        x.register_hook(hook)
        (x * 2).sum().backward()
    assert torch.get_rng_state is real
    inner_states = [r for r in events(inner) if r["op"] == "torch.get_rng_state"]
    assert [(r["action"], r["bytes"], r["storage"]) for r in inner_states] == [(ALLOC, RNG_BYTES, key(s))]
    assert alloc_of(outer, s)["phase"] == "other"
    assert alloc_of(outer, got["state"])["category"] == "activation"  # a forward replayed in backward
    assert alloc_of(outer, got["plain"])["category"] == "temporary"
    assert alloc_of(outer, got["plain"])["phase"] == "backward"


def test_gradients_optimizer_state_parameters_and_buffers():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3), nn.Linear(3, 2))
    frozen = nn.Linear(2, 2)
    frozen.requires_grad_(False)
    net.append(frozen)
    x = torch.randn(5, 4)
    opt = torch.optim.AdamW(net[0].parameters())
    (net(x).sum()).backward()
    net[2].weight.grad = None  # one parameter with a grad before the window, the others not
    params = [p for p in net.parameters()]
    grads_before = [p.grad for p in params if p.grad is not None]
    assert len(grads_before) == 5 and frozen.weight.grad is None
    with track(net, optimizer=opt, inputs={"x": x, "n": 3}) as tl:
        assert tl.baseline_by_category["gradient"] == nbytes(*grads_before)  # before any backward
        net(x).sum().backward()
        opt.step()
    base = tl.baseline_by_category
    assert base["parameter"] == nbytes(*params)
    assert base["buffer"] == nbytes(*net.buffers())
    assert base["gradient"] == nbytes(*grads_before)
    assert base["optimizer_state"] == 0 and base["input"] == nbytes(x)
    assert alloc_of(tl, net[2].weight.grad)["category"] == "gradient"
    state = [v for s in opt.state.values() for v in s.values()]
    assert all(alloc_of(tl, v)["category"] == "optimizer_state" for v in state)
    end = tl.bytes_by_category_at(len(tl) - 1)
    assert end["optimizer_state"] == nbytes(*state)
    assert end["gradient"] == nbytes(*[p.grad for p in params if p.grad is not None])
    assert all(not p._post_accumulate_grad_hooks for p in params if p._post_accumulate_grad_hooks is not None)


def test_existing_optimizer_state_is_baseline_and_modules_found_by_hooks_register_only_their_own():
    w = nn.Parameter(torch.randn(6))
    opt = torch.optim.SGD([w], lr=0.1, momentum=0.9)
    w.grad = torch.ones(6)
    opt.step()
    w.grad = None
    outer = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3))
    extra = nn.Linear(5, 5)
    x = torch.randn(3)
    with torch.no_grad(), track() as tl:  # nothing passed: the hooks find the modules and the optimizer
        outer(x)
        w.grad = torch.ones(6)
        opt.step()
    assert tl.baseline_by_category["parameter"] == nbytes(*outer.parameters())  # extra never ran
    assert tl.baseline_by_category["optimizer_state"] == nbytes(opt.state[w]["momentum_buffer"])
    assert tl.baseline_by_category["input"] == 0
    with track(extra) as tl2:
        pass
    assert tl2.baseline_by_category["parameter"] == nbytes(*extra.parameters())


def test_register_module_without_recursion_and_twice():
    net = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3))
    t = Tracker()
    t.register_module(net, recurse=False)
    assert t._baseline["parameter"] == 0  # the container has no parameters of its own
    t.register_module(net[0], recurse=False)
    t.register_module(net)  # net[0] already seen: counted once
    assert t._baseline["parameter"] == nbytes(*net.parameters())
    t.stop()
    assert all(not p._post_accumulate_grad_hooks for p in net.parameters())


def test_tag_and_register_move_bytes_between_categories():
    a, b = torch.zeros(100), torch.zeros(7)
    with track(inputs={"a": a, "b": b, "none": None}) as tl:
        assert tl.baseline_by_category["input"] == nbytes(a, b)
        before = tl.peak_bytes
        tag(a, "ema")  # a live timeline sees the baseline change
        assert tl.baseline_by_category["ema"] == nbytes(a) and tl.peak_bytes == before
        tag([a], "ema")  # already ema: nothing moves
        c = torch.empty(9)
        tag([c, 3, torch.empty(0)], "ema")  # non-tensors and empty storages are skipped
        tag(c, "ema")
    base = tl.baseline_by_category
    assert base["input"] == nbytes(b) and base["ema"] == nbytes(a) and tl.baseline_bytes == nbytes(a, b)
    assert alloc_of(tl, c)["category"] == "ema"
    tag(c, "ema")  # no tracker: a no-op
    assert not tracking()


def test_a_pre_window_storage_dying_inside_is_a_free_of_its_category():
    a = torch.zeros(25)
    storage = key(a)
    inputs = {"a": a}
    with track(inputs=inputs) as tl:
        del a
        inputs.clear()
    assert [(r["action"], r["bytes"], r["category"], r["storage"]) for r in events(tl)] == [
        (FREE, 100, "input", storage)
    ]
    assert tl.end_bytes == 0 and tl.baseline_bytes == 100


def test_a_retag_after_a_look_shows_at_the_next_look():
    m = Keeper()
    x = torch.randn(2, 4)
    with track(m, inputs=x) as tl:
        y = m(x)
        assert tl.peak_by_category()["activation"] == 0
        n = len(tl)
        torch.autograd.grad(y.sum(), [m.lin.weight])  # backward starts: m.kept and y become activations
        assert len(tl) > n
        assert tl.bytes_by_category_at(n - 1)["activation"] == nbytes(m.kept, y)


# ---- track()'s arguments and lifecycle ---------------------------------------------------------------------------


def test_inputs_and_owned_in_every_form():
    x, y, z = torch.zeros(4), torch.zeros(5), torch.zeros(6)

    class Handle:
        def owned(self):
            return {"ema": [z]}

    with track(inputs={"a": x, "b": [y, 1]}) as tl:
        pass
    assert tl.baseline_by_category["input"] == nbytes(x, y)
    with track(inputs=x) as tl:
        pass
    assert tl.baseline_by_category["input"] == nbytes(x)
    with track(inputs=(x, (y,))) as tl:
        pass
    assert tl.baseline_by_category["input"] == nbytes(x, y)
    with track(owned=Handle()) as tl:
        pass
    assert tl.baseline_by_category["ema"] == nbytes(z)
    with track(owned={"ema": z, "buffer": (x, y)}) as tl:
        pass
    assert tl.baseline_by_category["ema"] == nbytes(z) and tl.baseline_by_category["buffer"] == nbytes(x, y)
    with track(owned=None, inputs=None) as tl:
        pass
    assert tl.baseline_bytes == 0


def test_bad_arguments_name_themselves():
    with pytest.raises(TypeError, match="owned must be a memkit.Handle or a mapping category -> tensors, got list"):
        with track(owned=[torch.zeros(1)]):
            pass
    with pytest.raises(ValueError, match="category must be one of .*got 'weights'"):
        with track(owned={"weights": [torch.zeros(1)]}):
            pass
    with pytest.raises(ValueError, match="category must be one of .*got 'weights'"):
        tag([], "weights")
    with pytest.raises(ValueError, match=r"phase must be one of \['forward', .*got 'warmup'"):
        with phase("warmup"):
            pass
    with pytest.raises(TypeError, match="model must be a torch.nn.Module or None, got str"):
        with track(model="flux"):
            pass
    with pytest.raises(TypeError, match="optimizer must be a torch.optim.Optimizer or None, got dict"):
        with track(optimizer={}):
            pass
    for bad in (0, -512, 1.5, "512"):
        with pytest.raises(ValueError, match=f"alloc_granularity must be a positive int or None, got {bad!r}"):
            with track(alloc_granularity=bad):
                pass
    with track(alloc_granularity=1) as tl:
        a = torch.empty(3)
    assert alloc_of(tl, a)["bytes"] == 12
    assert not tracking() and _get_current_dispatch_mode() is None


def test_hooks_and_mode_are_removed_after_stop_even_when_the_block_raises():
    net = nn.Linear(2, 2)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    with pytest.raises(RuntimeError, match="boom"):
        with track(net, optimizer=opt) as tl:
            assert tracking() and _get_current_dispatch_mode() is not None
            raise RuntimeError("boom")
    assert not tracking() and _get_current_dispatch_mode() is None
    assert not torch.nn.modules.module._global_forward_pre_hooks
    assert not torch.nn.modules.module._global_forward_hooks
    from torch.optim import optimizer as optim_module

    assert not optim_module._global_optimizer_pre_hooks and not optim_module._global_optimizer_post_hooks
    assert all(not p._post_accumulate_grad_hooks for p in net.parameters())
    net(torch.ones(2)).sum().backward()
    opt.step()
    assert len(tl) == 0
    Tracker().stop()  # stop() without start() is safe


def test_nested_trackers_each_see_their_window():
    with track() as outer:
        a = torch.empty(100)
        with track() as inner:
            assert tracking()
            b = torch.empty(50)
            with phase("ema"):
                c = torch.empty(2)
                tag(c, "ema")
            del b
        assert tracking()
        del a
    assert not tracking()
    assert inner.peak_bytes - inner.baseline_bytes == 208 and len(inner) == 3
    assert outer.peak_bytes - outer.baseline_bytes == 608 and len(outer) == 5
    assert alloc_of(outer, c)["category"] == alloc_of(inner, c)["category"] == "ema"
    assert alloc_of(outer, c)["phase"] == "ema"


def test_cuda_history_is_started_only_when_asked_or_available(monkeypatch):
    calls = []
    snapshot = Timeline(columns={}, meta={})

    class FakeHandle:
        def remove(self):
            calls.append("stop")

    monkeypatch.setattr(recording_module, "record_cuda_history", lambda n: calls.append(("start", n)) or FakeHandle())
    monkeypatch.setattr(recording_module, "cuda_snapshot", lambda: calls.append("snapshot") or snapshot)
    monkeypatch.setattr(recording_module, "cuda_history_available", lambda: False)
    with track() as tl:
        pass
    with track(cuda_history=False):
        pass
    assert calls == [] and "cuda" not in tl.meta
    monkeypatch.setattr(recording_module, "cuda_history_available", lambda: True)
    with track(max_entries=7) as tl:
        pass
    assert calls == [("start", 7), "snapshot", "stop"] and tl.meta["cuda"] is snapshot
    calls.clear()
    with track(cuda_history=False):
        pass
    with track(cuda_history=True) as tl:
        pass
    assert calls == [("start", 100_000), "snapshot", "stop"]


def test_lower_bound_ops_are_flagged_with_learning_off(monkeypatch):
    monkeypatch.setenv("MEMKIT_LEARN_WORKSPACE", "0")
    monkeypatch.setattr(cp, "cpu_path", lambda: _path(x86=False, aten_capability="SVE256", onednn_isa="NONE"))
    a = torch.randn(3, 4)
    b = torch.randn(4, 2)
    with track(inputs=[a, b]) as tl:
        out = torch.mm(a, b)
        torch.addmm(out, a, b)
        torch.mm(a, b)
        assert tl.meta.get("lower_bound_ops") is None  # written at stop
    assert tl.meta["lower_bound_ops"] == ["aten.addmm", "aten.mm"]  # each op once, sorted
    assert alloc_of(tl, out)["bytes"] == 24 and not [r for r in events(tl) if r["storage"] == -1]
    monkeypatch.setattr(cp, "cpu_path", _path)  # the modelled x86 path: nothing to flag
    with track(inputs=[a, b]) as tl:
        torch.mm(a, b)
    assert tl.meta["lower_bound_ops"] == []


def test_snapshot_versions_and_meta():
    t = Tracker(label="x")
    assert t._snapshot(None)[0] == (0, 0, tuple([0] * len(CATEGORIES)))
    version, columns, meta = t._snapshot(None)
    assert t._snapshot(version) is None
    assert set(columns) >= {"bytes", "storage"} and meta["baseline"] == dict.fromkeys(CATEGORIES, 0)
    t.start()
    try:
        a = torch.ones(3)
    finally:
        t.stop()
    version2, columns, meta = t._snapshot(version)
    assert version2 != version and meta["devices"] == ["cpu"] and meta["ops"] == ["aten.ones.default"]
    assert meta["frames"] == [] and list(columns["bytes"]) == [12]
    del a


def test_nested_modules_and_nested_optimizer_steps_keep_their_phase_until_the_outermost_returns():
    opt_inner = torch.optim.SGD([nn.Parameter(torch.randn(2))], lr=0.1)
    opt_outer = torch.optim.SGD([nn.Parameter(torch.randn(2))], lr=0.1)
    got = {}

    class Outer(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = nn.Sequential(nn.Linear(2, 2))
            self.unused = nn.BatchNorm1d(50)  # a child its forward never calls (parameters and buffers)

        def forward(self, x):
            h = self.inner(x)
            got["after_child"] = torch.empty(3)  # still in the outer forward
            return h

    def closure():
        opt_inner.step()
        got["after_inner_step"] = torch.empty(4)  # still in the outer step

    net = Outer()
    with torch.no_grad(), track() as tl:
        net(torch.ones(2))
        got["after_forward"] = torch.empty(5)
        opt_outer.step(closure)
        got["after_step"] = torch.empty(6)
    phases = {name: alloc_of(tl, t)["phase"] for name, t in got.items()}
    assert phases == {
        "after_child": "forward",
        "after_forward": "other",
        "after_inner_step": "optimizer",
        "after_step": "other",
    }
    # the forward hooks register the modules that run, not their unused children
    assert tl.baseline_by_category["parameter"] == nbytes(*net.inner.parameters())
    assert tl.baseline_by_category["buffer"] == 0


def test_a_module_run_twice_is_registered_and_hooked_once():
    lin = nn.Linear(3, 3)
    x = torch.randn(3)
    with track() as tl:
        lin(x)
        lin(x)
        assert [len(p._post_accumulate_grad_hooks or {}) for p in lin.parameters()] == [1, 1]
        lin(x).sum().backward()
    assert tl.baseline_by_category["parameter"] == nbytes(*lin.parameters())
    assert alloc_of(tl, lin.weight.grad)["category"] == "gradient"


def test_tag_takes_one_tensor_or_an_iterable():
    scalar = torch.tensor(1.5)  # 0-dim: not iterable
    pair = (torch.zeros(3), torch.zeros(4))
    with track() as tl:
        tag(scalar, "ema")
        tag(iter(pair), "buffer")
        tag([], "ema")
    assert tl.baseline_by_category["ema"] == nbytes(scalar)
    assert tl.baseline_by_category["buffer"] == nbytes(*pair)


def test_pre_window_storages_tagged_one_by_one_add_up():
    a, b = torch.zeros(10), torch.zeros(20)
    with track(inputs=[a, b]) as tl:
        tag(a, "ema")
        tag(b, "ema")
    assert tl.baseline_by_category["ema"] == nbytes(a, b) and tl.baseline_by_category["input"] == 0


def test_an_explicit_backward_phase_outside_autograd_with_a_saved_number_alive():
    x = torch.randn(5, requires_grad=True)
    with track(inputs=x) as tl:
        y = x / 2.0  # a saved divisor is alive
        with phase("backward"):  # no autograd node is running
            z = x.detach() * 3.0
    assert alloc_of(tl, z)["phase"] == "backward"
    internal = [r for r in events(tl) if r["storage"] == -1 and r["phase"] == "backward"]
    assert [r["bytes"] for r in internal] == [2 * 8 + 4] * 2  # the number, its copy, its cast: none reused
    del y


def test_learned_buffers_that_cannot_be_learned_are_flagged(monkeypatch):
    from memkit.memory.workspace import learned

    monkeypatch.setattr(cp, "cpu_path", lambda: _path(x86=False, aten_capability="SVE256", onednn_isa="NONE"))
    monkeypatch.setattr(learned, "_cache", {})
    monkeypatch.setattr(learned, "_ask", lambda op, args, kwargs, threads: {"aten::mm.default": 96}.get(op))
    a, b = torch.randn(3, 4), torch.randn(4, 2)
    with track(inputs=[a, b]) as tl:
        torch.mm(a, b)  # learned: 96 bytes
        torch.addmm(torch.zeros(2), a, b)  # the worker has no answer: flagged
    assert tl.meta["lower_bound_ops"] == ["aten.addmm"]
    assert [r["bytes"] for r in events(tl) if r["storage"] == -1] == [96, 96]


def test_storages_made_off_device_are_host_memory_not_timeline():
    from memkit.memory import off_device

    a = torch.randn(16)
    with track(inputs=a) as tl:
        on = a.clone()  # 64 B on the device
        with off_device():
            h1 = a.clone()  # 64 B in host memory
            h2 = torch.empty(32)  # 128 B: both alive, the host peak
            view = h1[:4]  # a view: no new storage
        del h1, view
        h3 = h2.clone()  # outside again: on the device
        del h2
        with off_device():
            h4 = torch.empty(8)  # 32 B: below the host peak
    assert [r["bytes"] for r in events(tl) if r["action"] == ALLOC] == [64, 128]
    assert tl.peak_bytes - tl.baseline_bytes == nbytes(on, h3)
    assert tl.meta["host_peak_bytes"] == 64 + 128
    del on, h3, h4
    with track() as quiet:
        torch.empty(4)
    assert quiet.meta["host_peak_bytes"] == 0


def test_host_state_is_off_the_timeline_by_category_and_a_host_optimizer_steps_there():
    from memkit.memory import host_state

    w = nn.Parameter(torch.randn(32))  # 128 B, declared in host memory (FSDP's offloaded shards)
    on_device = nn.Parameter(torch.randn(8))  # 32 B
    host_opt = torch.optim.SGD([w], lr=0.1, momentum=0.9)
    device_opt = torch.optim.SGD([on_device], lr=0.1, momentum=0.9)
    with track(host={"parameter": [w]}, optimizer=host_opt) as tl:
        tag([w], "parameter")  # registering it again keeps it in host memory
        with host_state():
            w.grad = torch.ones(32)  # 128 B: host state...
        tag([w.grad], "gradient")  # ...whose category is set as for any storage
        assert tracker_module.in_host_state(w) and tracker_module.in_host_state(w.grad)
        assert not tracker_module.in_host_state(on_device)
        host_opt.step()  # the momentum buffer (128 B) and any temporaries: host state, w being there
        on_device.grad = torch.ones(8)  # 32 B on the device
        tag([on_device.grad], "gradient")
        device_opt.step()  # its momentum buffer (32 B): on the device
    # the momentum buffer, made inside the step, is optimizer state from its allocation on (as a retag on the
    # timeline): no host temporary
    assert tl.meta["host_state_bytes"] == {"parameter": 128, "gradient": 128, "optimizer_state": 128}
    assert tl.baseline_by_category["parameter"] == 0  # on_device was never given to the tracker
    assert tl.peak_by_category()["optimizer_state"] == 32 and tl.peak_by_category()["gradient"] == 32
    assert tl.peak_bytes == 64


def test_host_state_is_only_what_it_is_told():
    x = torch.randn(16)
    with track(host={"ema": []}) as tl:
        y = x.clone()  # 64 B on the device
    assert tl.meta["host_state_bytes"] == {} and tl.peak_bytes == nbytes(y)


# ---- what each row says when there is nothing to say (mutation testing: -1 codes, times, devices) ---------------


def _step_with_every_kind_of_row():
    """A window with a saved divisor (freed by backward), a divisor not saved (freed at once), a kernel buffer
    (its alloc and free rows) and plain frees: every path that appends a row."""
    x = torch.randn(100, requires_grad=True)
    q = torch.randn(1, 2, 16, 8)
    t0 = time.perf_counter()
    with track(inputs=[x, q]) as tl:
        y = x / 2.0
        b = x / 4.0
        del b
        torch.empty(1)
        out = torch.nn.functional.scaled_dot_product_attention(q, q, q)
        del out
        y.sum().backward()
    wall = time.perf_counter() - t0
    return tl, wall


def test_without_record_stacks_no_row_has_a_site_and_frees_name_no_op():
    tl, _ = _step_with_every_kind_of_row()
    assert tl.frames == []
    assert set(tl.column("frame").tolist()) == {-1}  # -1 is "no frame" (codes index tl.frames)
    cols = (tl.column("action").tolist(), tl.column("op").tolist(), tl.column("storage").tolist())
    rows = list(zip(*cols, strict=True))
    frees = [(op, s) for a, op, s in rows if a == FREE and s != -1]  # (kernel buffers name their op)
    assert any(s < -1 for _, s in frees) and any(s >= 0 for _, s in frees)  # saved numbers and storages
    assert {op for op, _ in frees} == {-1}
    assert all(op >= 0 for a, op, _ in rows if a == ALLOC)  # every allocation names the op that made it


def test_times_are_seconds_since_start_in_row_order():
    tl, wall = _step_with_every_kind_of_row()
    t = tl.column("time")
    assert len(t) >= 8 and all(0.0 <= v <= wall for v in t.tolist())
    assert (np.diff(t) >= 0).all()  # rows are appended as things happen


def test_record_stacks_gives_a_saved_number_its_site():
    x = torch.randn(10, requires_grad=True)
    with track(inputs=x, record_stacks=True) as tl:
        y = x / 2.0
    (saved,) = [r for r in events(tl) if r["storage"] < -1]
    lines = [ln for ln in saved["frame"].split("\n") if "/mutmut/" not in ln]
    assert lines[-1].endswith(" test_record_stacks_gives_a_saved_number_its_site")
    del y


def test_register_skips_what_has_no_bytes_or_is_no_tensor_and_goes_on():
    one = torch.zeros(1, dtype=torch.uint8)  # one byte: counted
    empty = torch.zeros(0)
    t = torch.zeros(4)
    with track(inputs=[empty, one]) as tl:
        tag([None, t], "ema")
    assert tl.baseline_by_category["input"] == 1
    assert tl.baseline_by_category["ema"] == nbytes(t)


def test_owned_tensors_from_any_iterable_and_a_single_0_dim_tensor():
    a, b = torch.zeros(3), torch.zeros(5)
    scalar = torch.tensor(1.0)  # 0-dim: not iterable
    with track(owned={"ema": (t for t in (a, b)), "buffer": scalar}) as tl:
        pass
    assert tl.baseline_by_category["ema"] == nbytes(a, b)
    assert tl.baseline_by_category["buffer"] == scalar.untyped_storage().nbytes() == 4


def test_host_memory_goes_down_by_what_dies():
    from memkit.memory import off_device

    with track() as tl:
        with off_device():
            a = torch.empty(25)  # 100 B
            b = torch.empty(50)  # 200 B: 300 alive
            del a  # 200 alive
            c = torch.empty(75)  # 300 B: 500 alive, the peak
    assert tl.meta["host_peak_bytes"] == 200 + 300
    del b, c


def test_storages_on_another_device_are_named_by_it():
    m = torch.empty(8, device="meta")
    x = torch.empty(8, device="meta", requires_grad=True)
    with track(inputs=[m, x]) as tl:
        y = torch.empty(4, device="meta")
        z = torch.empty(2)
        w = x / 2.0  # a saved divisor on the output's device
    assert tl.devices == ["meta", "cpu"]  # in order of first appearance: the inputs first
    assert alloc_of(tl, y)["device"] == "meta" and alloc_of(tl, z)["device"] == "cpu"
    saved = [r for r in events(tl) if r["storage"] < -1 and r["action"] == ALLOC]
    assert [r["device"] for r in saved] == ["meta"]
    del y, z, w


def test_a_buffer_of_an_op_without_a_tensor_output_is_put_on_cpu_or_the_named_device():
    plain = Tracker()
    code = plain._device_code(None)
    assert plain.log.devices.items[code] == "cpu"
    named = Tracker(device="cuda:1")
    assert named.log.devices.items[named._device_code(None)] == "cuda:1"


class Halve(nn.Module):
    def forward(self, x):
        return x / 2.0


def test_a_number_saved_in_the_forward_is_an_activation_once_backward_starts():
    x = torch.randn(100, requires_grad=True)
    with track(inputs=x) as tl:
        y = Halve()(x)
        y.sum().backward()
    saved = [r for r in events(tl) if r["storage"] < -1 and r["action"] == ALLOC]
    assert [(r["bytes"], r["phase"], r["category"]) for r in saved] == [(8, "forward", "activation")]


class CloneGrad(torch.autograd.Function):
    """Identity whose backward is a single op (a clone)."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        return g.clone()


def test_a_backward_of_one_op_still_makes_the_forwards_survivors_activations():
    x = torch.tensor(2.0, requires_grad=True)
    with track(inputs=x) as tl:
        with phase("forward"):
            kept = torch.empty(8)
            y = CloneGrad.apply(x)
        (gx,) = torch.autograd.grad(y, x)
    backward_allocs = [r for r in events(tl) if r["phase"] == "backward" and r["action"] == ALLOC]
    assert len(backward_allocs) == 1  # the clone: the backward's only op
    assert alloc_of(tl, kept)["category"] == "activation"
    assert gx.item() == 1.0
    del kept


def test_views_and_in_place_ops_on_a_storage_the_tracker_never_saw_add_nothing():
    x = torch.randn(64)  # not passed to track: unknown to the tracker
    with track() as tl:
        v = x.view(8, 8).t()
        x.neg_()  # in place, no Python number (a wrapped one would be a kernel buffer)
    assert len(tl) == 0 and tl.peak_bytes == 0
    del v


def test_a_named_non_cpu_device_flags_no_cpu_kernel_path(monkeypatch):
    monkeypatch.setenv("MEMKIT_LEARN_WORKSPACE", "0")
    monkeypatch.setattr(cp, "cpu_path", lambda: _path(x86=False, aten_capability="SVE256", onednn_isa="NONE"))
    a, b = torch.randn(3, 4), torch.randn(4, 2)
    with track(inputs=[a, b], device="cuda:0") as tl:
        out = torch.mm(a, b)  # a CUDA matmul's buffers are not the CPU kernel's: nothing unmodelled to flag
    assert tl.meta["lower_bound_ops"] == []
    assert [r["bytes"] for r in events(tl)] == [nbytes(out)]  # and no kernel buffer rows
    with track(inputs=[a, b]) as tl:
        torch.mm(a, b)  # the same call measured for the CPU: its path is not modelled
    assert tl.meta["lower_bound_ops"] == ["aten.mm"]


# ---- storages resized in place (how FSDP2 frees and regathers its unsharded parameters) -------------------------


def test_resizing_a_storage_in_place_frees_its_bytes_then_allocates_the_new_ones_in_its_category():
    x = torch.zeros(1000)  # 4000 B, an input: in the baseline
    original = torch.UntypedStorage.resize_
    with track(inputs={"x": x}, record_stacks=True) as tl:
        assert torch.UntypedStorage.resize_ is not original  # watched only while tracking
        s = x.untyped_storage()
        assert s.resize_(4000) is s  # the same size: nothing happens, and resize_ still returns its storage
        y = torch.ones(10)  # 40 B, made in the window: a temporary
        y.untyped_storage().resize_(0)  # freed...
        y.untyped_storage().resize_(80)  # ...and allocated again, larger, still a temporary
        s.resize_(0)
        s.resize_(2000)  # the input regathered at half its size
        del y  # its free: the regrown size
    assert torch.UntypedStorage.resize_ is original
    mine = [(r["action"], r["bytes"], r["category"]) for r in events(tl) if r["storage"] == key(x)]
    assert mine == [(FREE, 4000, "input"), (ALLOC, 2000, "input")]
    grown = [r for r in events(tl) if r["storage"] == key(x) and r["action"] == ALLOC][0]
    assert grown["op"] == "UntypedStorage.resize_" and grown["phase"] == "other" and grown["device"] == "cpu"
    assert grown["frame"] is not None and "test_resizing_a_storage" in grown["frame"]
    temps = [(r["action"], r["bytes"]) for r in events(tl) if r["category"] == "temporary"]
    assert temps == [(ALLOC, 40), (FREE, 40), (ALLOC, 80), (FREE, 80)]
    assert tl.live_by_category()["input"].tolist()[-1] == 2000
    assert tl.peak_bytes == 4000 + 80 and tl.end_bytes == 2000  # y regrown while x was whole


def _calling_in_backward(fn):
    """An identity autograd function whose backward returns ``fn(grad)``: code run inside the backward."""

    class CallInBackward(torch.autograd.Function):
        @staticmethod
        def forward(ctx, t):
            return t * 1

        @staticmethod
        def backward(ctx, g):
            return fn(g)

    return CallInBackward


def test_a_storage_first_seen_resized_is_a_temporary_of_its_rounded_size_in_the_phase_it_grows_in():
    before = torch.zeros(3)  # never given to the tracker
    w = nn.Parameter(torch.randn(4))
    grown = torch.zeros(2)

    def regrow(g):
        grown.untyped_storage().resize_(48)  # regrown in the backward
        return g

    Grow = _calling_in_backward(regrow)

    with track(alloc_granularity=512) as tl:
        before.untyped_storage().resize_(100)  # unknown until now: a temporary of its new (rounded) size
        grown.untyped_storage().resize_(0)  # unknown and shrunk: nothing was counted, nothing to free
        Grow.apply(w).sum().backward()
    rows = events(tl)
    first = [(r["action"], r["bytes"], r["category"], r["phase"]) for r in rows if r["storage"] == key(before)]
    assert first == [(ALLOC, 512, "temporary", "other")]
    regrown = [(r["action"], r["bytes"], r["category"], r["phase"]) for r in rows if r["storage"] == key(grown)]
    assert regrown == [(ALLOC, 512, "temporary", "backward")]


def test_host_state_resized_in_place_stays_off_the_timeline():
    from memkit.memory import host_state

    with track() as tl:
        with host_state():
            h = torch.zeros(64)  # 256 B of host state
        tag([h], "gradient")
        h.untyped_storage().resize_(0)
        h.untyped_storage().resize_(1024)
    assert tl.peak_bytes == 0 and len(tl) == 0
    assert tl.meta["host_state_bytes"] == {"gradient": 256}


def test_a_storage_registered_while_resized_to_zero_regrows_in_its_registered_category():
    z = torch.zeros(4)
    z.untyped_storage().resize_(0)  # an FSDP unsharded parameter between uses: no bytes yet
    with track() as tl:
        tag([z], "parameter")  # nothing to count now...
        assert tl.baseline_by_category["parameter"] == 0
        z.untyped_storage().resize_(64)  # ...its role when it regrows
    assert [(r["action"], r["bytes"], r["category"]) for r in events(tl)] == [(ALLOC, 64, "parameter")]


def test_a_wrapper_subclass_counts_its_inner_tensors_not_its_own_storage():
    """A traceable wrapper subclass (a DTensor, here torch's test TwoTensor) holds no memory of its own: its
    inner tensors do, at any depth."""
    from torch.testing._internal.two_tensor import TwoTensor

    a, b, c, d = (torch.zeros(4) for _ in range(4))
    flat = TwoTensor(a, b)
    nested = TwoTensor(TwoTensor(a, b), TwoTensor(c, d))
    assert [key(t) for t in tracker_module._plain(nested)] == [key(t) for t in (a, b, c, d)]
    with track(inputs={"flat": flat}) as tl:
        pass
    assert tl.baseline_by_category["input"] == nbytes(a, b) == 32
    with track(inputs={"nested": nested}) as tl:
        pass
    assert tl.baseline_by_category["input"] == nbytes(a, b, c, d)


def test_resize_rows_say_no_op_or_site_on_frees_and_their_times_are_in_the_window():
    torch.ones(3) + 1  # ops before, so the resized storage's op code is not 0, the device's code
    t0 = time.perf_counter()
    with track() as tl:
        a = torch.zeros(5)
        b = a * 2  # allocated by a second op: a nonzero op code in its row
        b.untyped_storage().resize_(0)
        b.untyped_storage().resize_(64)
        tag([b], "gradient")  # the regrown storage is retagged like any other: its allocation row changes category
    wall = time.perf_counter() - t0
    rows = [r for r in events(tl) if r["storage"] == key(b)]
    assert [(r["action"], r["bytes"]) for r in rows] == [(ALLOC, 20), (FREE, 20), (ALLOC, 64)]
    assert [r["device"] for r in rows] == ["cpu"] * 3
    assert rows[1]["op"] is None and rows[2]["op"] == "UntypedStorage.resize_"
    assert set(tl.column("frame").tolist()) == {-1}  # no record_stacks: no sites, -1 exactly
    assert set(tl.column("op").tolist()) - {-1} and min(tl.column("op").tolist()) >= -1
    times = tl.column("time").tolist()
    assert times == sorted(times) and 0 <= times[0] and times[-1] <= wall
    assert tl.peak_by_category()["gradient"] == 64  # the retag reached the regrown allocation
    assert tl.live_by_category()["temporary"].tolist()[-1] == nbytes(a)


def test_a_storage_regrown_by_a_module_run_in_the_backward_is_an_activation():
    """Checkpointing recomputes a block (a module's forward) inside the backward: what it makes there is an
    activation, as for an op; a resize there too."""
    grown = torch.zeros(2)

    class Regather(nn.Module):
        def forward(self, g):
            grown.untyped_storage().resize_(48)
            return g

    Back = _calling_in_backward(Regather())

    w = nn.Parameter(torch.randn(4))
    grown.untyped_storage().resize_(0)
    with track() as tl:
        Back.apply(w).sum().backward()
    regrown = [(r["action"], r["bytes"], r["category"], r["phase"]) for r in events(tl) if r["storage"] == key(grown)]
    assert regrown == [(ALLOC, 48, "activation", "backward")]


def test_host_memory_seen_again_through_a_view_is_not_a_device_allocation():
    from memkit.memory import host_state, off_device

    with track() as tl:
        with off_device():
            copy = torch.ones(64)  # a host copy (an offloaded checkpoint)
        with host_state():
            state = torch.ones(32)  # host state
        views = [copy.view(8, 8), state.view(4, 8), copy[1:], state.t() if state.dim() == 2 else state[:]]
        del views
    assert len(tl) == 0 and tl.peak_bytes == 0
    assert tl.meta["host_peak_bytes"] == nbytes(copy)
    assert tl.meta["host_state_bytes"] == {"temporary": nbytes(state)}  # untagged host state: a temporary


def test_host_state_counts_the_most_alive_at_once_not_the_sum():
    from memkit.memory import host_state

    with track() as tl:
        with host_state():
            first = torch.ones(64)  # 256 B
        tag([first], "gradient")
        del first  # freed before the next one
        with host_state():
            second = torch.ones(32)  # 128 B
            third = torch.ones(16)  # 64 B, alive with the second
        tag([second, third], "gradient")
    assert tl.meta["host_state_bytes"] == {"gradient": max(256, 128 + 64)}
    with track() as tl:
        with host_state():
            a, b = torch.ones(64), torch.ones(64)
        tag([a, b], "ema")
        del a
        with host_state():
            c = torch.ones(64)
        tag([c], "ema")
    assert tl.meta["host_state_bytes"] == {"ema": 512}  # a freed before c: two alive at most, not three
    del b, c


def test_released_records_a_free_now_and_tag_made_allocates_the_same_storage_again(tmp_path):
    """Pages given back while the storage lives on (a kept mapping's ``MADV_DONTNEED``): ``released`` is a free at
    that moment, once (the storage dying later records nothing more); tagged with ``made`` again, the same storage
    is an allocation again. Host memory (made under ``off_device``) comes off the host count instead."""
    import mmap

    path = tmp_path / "weights.bin"
    path.write_bytes(bytes(range(256)) * 64)  # 16 KiB

    def mapped() -> torch.Tensor:
        with open(path, "rb") as f:
            return torch.frombuffer(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY), dtype=torch.uint8)

    t, u = mapped(), mapped()
    with track() as tl:
        tag(t, "parameter", made="mmap")
        released(t)
        released(t)  # not live any more: nothing
        tag(t, "parameter", made="mmap")
        released(t[:64])  # a view: its storage
        with off_device():
            tag(t, "parameter", made="mmap")
            released(t)
            tag(u, "parameter", made="mmap")  # the most host memory at once: u alone
    rows = [(r["action"], r["bytes"], r["category"]) for r in events(tl) if r["category"] == "parameter"]
    assert rows == [(ALLOC, 16384, "parameter"), (FREE, 16384, "parameter")] * 2
    assert tl.meta["host_peak_bytes"] == 16384
    del t
    assert len([r for r in events(tl) if r["action"] == FREE]) == 2  # the storage dying adds no free


def test_tag_made_records_memory_made_outside_dispatch_as_allocated_now_and_freed_with_it(tmp_path):
    """A file mapped into memory (torch.frombuffer on an mmap: no op a tracker sees) tagged with ``made``: an
    allocation of its bytes at that moment, in the category given, under the op named, freed when the storage
    is; tagged without ``made`` the same memory counts as live since before the window (the baseline)."""
    import mmap

    path = tmp_path / "weights.bin"
    path.write_bytes(bytes(range(256)) * 64)  # 16 KiB

    def mapped() -> torch.Tensor:
        with open(path, "rb") as f:
            return torch.frombuffer(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY), dtype=torch.uint8)

    with track() as tl:
        torch.zeros(8)
        t = mapped()
        tag(t, "parameter", made="mmap")
        view = t[64:128].view(torch.float32)  # views of it are the same storage: nothing more
        tag(view, "parameter", made="mmap")
        del t, view
        u = mapped()
        tag(u, "parameter")  # not made here, as far as the tracker is told: the baseline
    ev = [r for r in events(tl) if r["op"] == "mmap"]
    assert [(r["action"], r["bytes"], r["category"]) for r in ev] == [(ALLOC, 16384, "parameter")]
    frees = [r for r in events(tl) if r["action"] == FREE and r["category"] == "parameter"]
    assert [r["bytes"] for r in frees] == [16384] and frees[0]["time"] > ev[0]["time"]
    assert tl.baseline_by_category["parameter"] == 16384  # u
    del u
