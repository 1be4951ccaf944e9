"""The roles half of the tracker (``memkit/memory/_roles.py``): which storages are host memory, kernel buffers of
ops that run on the host, registering what is already known, and the baseline storages listed for the allocator
replay. Found unchecked by mutation testing (``python -m bench.mutation roles``); each test states a documented
behaviour, with expected values from the tensors' own sizes."""

import torch
from torch import nn

from memkit.memory import host_state, off_device, tag, track
from memkit.memory.tracker import Tracker


def nbytes(*tensors) -> int:
    return sum({t.untyped_storage()._cdata: t.untyped_storage().nbytes() for t in tensors}.values())


def kernel_buffers(tl) -> list[int]:
    """Bytes of the kernel-internal buffers on the timeline (storage key -1: an alloc and its free)."""
    storage, action, size = (tl.column(n).tolist() for n in ("storage", "action", "bytes"))
    return [b for s, a, b in zip(storage, action, size, strict=True) if s == -1 and a == 0]


def attention(q: torch.Tensor) -> torch.Tensor:
    # the CPU flash-attention kernel allocates a buffer of its own (a workspace row on the timeline)
    return torch.nn.functional.scaled_dot_product_attention(q, q, q)


def test_a_kernels_buffer_is_on_the_timeline_on_the_device_but_not_off_it_or_in_host_state():
    q = torch.randn(1, 2, 16, 8)
    with track(inputs=[q]) as tl:
        attention(q)
    assert len(kernel_buffers(tl)) == 1 and kernel_buffers(tl)[0] > 0  # the control: a buffer on the device
    with track(inputs=[q]) as tl:
        with off_device():
            attention(q)
    assert kernel_buffers(tl) == [] and tl.peak_bytes == tl.baseline_bytes
    with track(inputs=[q]) as tl:
        with host_state():
            attention(q)
    assert kernel_buffers(tl) == [] and tl.peak_bytes == tl.baseline_bytes


class AttendingSGD(torch.optim.Optimizer):
    """Plain SGD whose step also runs one attention kernel (a stand-in for an optimizer whose kernels use a buffer)."""

    def __init__(self, params, q):
        super().__init__(params, {"lr": 0.1})
        self.q = q

    @torch.no_grad()
    def step(self, closure=None):
        attention(self.q)
        for group in self.param_groups:
            for p in group["params"]:
                p.add_(p.grad, alpha=-group["lr"])


def test_an_optimizer_stepping_on_the_host_keeps_its_kernels_buffers_off_the_timeline():
    q = torch.randn(1, 2, 16, 8)
    w = nn.Parameter(torch.randn(16))
    w.grad = torch.ones(16)
    opt = AttendingSGD([w], q)
    with track(optimizer=opt, inputs=[q]) as tl:  # w on the device: the step's buffer is on the timeline
        opt.step()
    assert len(kernel_buffers(tl)) == 1
    with track(host={"parameter": [w], "gradient": [w.grad]}, optimizer=opt, inputs=[q]) as tl:
        opt.step()  # every parameter in host memory: the step runs there, its kernel's buffer too
    assert kernel_buffers(tl) == [] and tl.peak_bytes == tl.baseline_bytes


def test_tagging_a_host_copy_with_device_tensors_skips_the_copy_and_tags_the_rest():
    d = torch.zeros(10)  # 40 B, before the window
    with track() as tl:
        with off_device():
            copy = torch.ones(6)  # a host copy: not on the device's timeline
        tag([copy, d], "ema")  # the copy first: the device tensor after it is tagged all the same
    assert tl.baseline_by_category["ema"] == nbytes(d) == 40
    assert tl.meta["host_peak_bytes"] == nbytes(copy)


def test_host_state_declared_up_front_keeps_its_category():
    shadow = torch.zeros(32)  # 128 B, an EMA's shadows kept in host memory
    with track(host={"ema": [shadow]}) as tl:
        torch.ones(4)
    assert tl.meta["host_state_bytes"] == {"ema": 128}
    assert tl.baseline_bytes == 0


def test_a_storage_already_on_the_device_is_not_made_host_state():
    x = torch.zeros(8)
    t = Tracker()
    t.register([x], "input")  # on the device's baseline first
    t.register_host([x], "parameter")  # too late: it stays where it is
    t.stop()
    assert t.timeline.meta["host_state_bytes"] == {}
    assert t.timeline.baseline_by_category == {**t.timeline.baseline_by_category, "input": 32, "parameter": 0}


def test_baseline_storages_are_listed_for_the_allocator_replay():
    a, b = torch.zeros(3), torch.zeros(100)  # 12 B and 400 B
    t = Tracker(alloc_granularity=512)
    t.register([a, b], "parameter")
    t.register([a], "parameter")  # already listed: once
    assert t.baseline_blocks == [(a.untyped_storage()._cdata, 512, 0), (b.untyped_storage()._cdata, 512, 0)]
    assert list(t.log.devices.items) == ["cpu"]  # device code 0
    t.stop()


def test_a_module_registered_twice_is_hooked_once():
    net = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3))
    t = Tracker()
    t.register_module(net[0])
    t.register_module(net)  # net[0] seen already
    t.register_module(net)
    assert [len(p._post_accumulate_grad_hooks or {}) for p in net.parameters()] == [1, 1, 1, 1]
    t.stop()
    assert all(not p._post_accumulate_grad_hooks for p in net.parameters())
