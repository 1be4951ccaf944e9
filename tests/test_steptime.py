"""Step time from the op stream: FLOPs per op from torch's formulas, recompute counted again, the roofline's max per op,
and the probe's extrapolation equal to counting every block. No timing of this machine is asserted."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import diffusers
import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils.flop_counter import FlopCounterMode, sdpa_flop_count

import memkit
from memkit.presets import PRESETS
from memkit.steptime import EFFICIENCY, NVME_READ, Op, OpCounts, count_ops, counting, step_seconds


@dataclass(frozen=True)
class FakeGPU:
    """An H100 SXM's figures, as the catalog will hold them (dense FLOP/s, HBM3 and PCIe 5.0 x16 bytes/s)."""

    flops: dict = field(default_factory=lambda: {"bf16": 989.4e12, "fp16": 989.4e12, "fp8": 1978.9e12})
    memory_bandwidth: float = 3.35e12
    host_link: float = 63e9
    nvlink: float | None = 450e9


def deep(preset: str, **layers: int):
    """The tiny preset with more blocks per list than the probe's 4 + 1 (memkit's tiny inputs)."""
    config = dict(PRESETS[preset].configs["tiny"]) | layers
    cls = getattr(diffusers, PRESETS[preset].model_class)

    def build():
        model = cls(**config)
        model._memkit_preset, model._memkit_size = preset, "tiny"
        return model

    return build


@pytest.mark.parametrize("bias", [False, True])
def test_linear_forward_and_backward_is_three_matmuls(bias):
    m, k, n = 64, 96, 80
    layer = torch.nn.Linear(k, n, bias=bias)
    x = torch.randn(m, k, requires_grad=True)
    with counting() as c:
        layer(x).sum().backward()
    assert c.by_class()["matmul"] == 3 * 2 * m * n * k  # forward, grad of the input, grad of the weight
    assert c.flops == c.by_class()["matmul"]  # elementwise ops are bytes, not FLOPs
    assert c.recompute_flops() == 0


def test_fake_tensors_count_the_same_as_real_ones():
    layer = torch.nn.Linear(32, 48)
    x = torch.randn(8, 32, requires_grad=True)
    with counting() as real:
        layer(x).sum().backward()
    with FakeTensorMode() as mode:
        fake_layer = torch.nn.Linear(32, 48)
        x = mode.from_tensor(torch.randn(8, 32, requires_grad=True))
        with counting() as fake:
            fake_layer(x).sum().backward()
    assert fake.ops == real.ops


def _sdpa(query, key, value, *args, out_shape=None, **kwargs):
    return sdpa_flop_count(query, key, value)


def test_checkpointing_all_adds_the_blocks_forward_flops_again():
    build = deep("flux", num_layers=3, num_single_layers=3)
    kwargs = dict(optimizer=None, steps=1, memoize=False)
    plain = count_ops(build, **kwargs)
    ckpt = count_ops(build, optimizations=[memkit.Checkpointing(pattern="all")], **kwargs)
    # the blocks' forward FLOPs, by torch's own per-module counter on one forward
    with FakeTensorMode(), torch.no_grad():
        model = build()
        inputs = memkit.make_inputs(model)
        # torch has no formula for the CPU flash kernel fake CPU tensors take: the CUDA kernels' one, as count_ops does
        cpu_flash = {torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: _sdpa}
        with FlopCounterMode(display=False, custom_mapping=cpu_flash) as flop_counter:
            model(**inputs)
    per_module = flop_counter.get_flop_counts()
    blocks = sum(
        sum(v.values())
        for name, v in per_module.items()
        if name.count(".") == 2 and (".transformer_blocks." in name or ".single_transformer_blocks." in name)
    )
    assert blocks > 0
    assert ckpt.flops - plain.flops == blocks
    assert ckpt.recompute_flops() == blocks
    assert plain.recompute_flops() == 0


def test_roofline_takes_the_slower_of_compute_and_memory():
    m = k = n = 4096
    nbytes = 2 * (m * k + k * n + m * n)
    counts = OpCounts(Counter({Op("matmul", 2 * m * n * k, 2 * (m * k + k * n), 2 * m * n, False): 1}))
    h100 = FakeGPU()
    t = step_seconds(counts, h100)
    f_eff, b_eff = EFFICIENCY["matmul"]
    assert t.seconds == pytest.approx(2 * m * n * k / (989.4e12 * f_eff))  # a large GEMM is compute-bound
    assert t.compute_bound_seconds == t.seconds and t.memory_bound_seconds == 0
    fast = FakeGPU(flops={"bf16": 1e21})  # FLOPs nearly free: the same matmul waits on its bytes
    t = step_seconds(counts, fast)
    assert t.seconds == pytest.approx(nbytes / (3.35e12 * b_eff))
    assert t.memory_bound_seconds == t.seconds and t.compute_bound_seconds == 0
    assert t.by_class["matmul"] == t.seconds


def test_transfers_and_disk_reads_are_timed_over_their_links():
    counts = OpCounts(Counter({Op("transfer", 0, 10**9, 0, False): 2, Op("disk", 0, 7 * 10**9, 0, False): 1}))
    t = step_seconds(counts, FakeGPU(), overlap=False)
    assert t.by_class["transfer"] == pytest.approx(2e9 / (63e9 * EFFICIENCY["transfer"][1]))
    assert t.by_class["disk"] == pytest.approx(7e9 / NVME_READ)
    assert t.seconds == t.transfer_seconds


@pytest.mark.parametrize(
    # CI time (16-21 s each): in make test-extended; tests/test_counted.py holds the estimate's count, with
    # checkpointing, to counting every block in CI
    "optimizations",
    [pytest.param([], marks=pytest.mark.extended), pytest.param([memkit.Checkpointing()], marks=pytest.mark.extended)],
    ids=str,
)
def test_the_probe_extrapolates_to_counting_every_block(optimizations):
    build = deep("flux", num_layers=6, num_single_layers=7)  # two lists, each longer than the probe's 4 + 1
    probed = count_ops(build, optimizations=optimizations)
    whole = count_ops(build, optimizations=optimizations, memoize=False)
    assert probed.meta["memoized"] and not whole.meta["memoized"]
    assert probed.ops == whole.ops  # every op kind, how many times: recompute, optimizer (AdamW, foreach) included


def test_offload_moves_weights_over_the_link_and_reads_disk():
    build = deep("flux", num_layers=2, num_single_layers=2)
    plain = count_ops(build, mode="inference")
    host = count_ops(build, mode="inference", optimizations=[memkit.Offload(to="cpu")])
    disk = count_ops(build, mode="inference", optimizations=[memkit.Offload(to="disk")])
    with FakeTensorMode():
        model = build()
        weights = sum(p.numel() * 2 for p in model.parameters() if p.numel() > 1)  # bf16, as counted
    assert plain.by_class("bytes")["transfer"] == plain.by_class("bytes")["disk"] == 0
    assert host.by_class("bytes")["transfer"] >= weights * 0.99  # every group loaded once per forward
    assert disk.by_class("bytes")["disk"] >= weights * 0.99
    assert host.flops == plain.flops == disk.flops
    gpu = FakeGPU()
    assert step_seconds(disk, gpu).seconds > step_seconds(host, gpu).seconds > step_seconds(plain, gpu).seconds


def test_gpu_without_a_roofline_is_refused_by_name():
    with pytest.raises(ValueError, match="memory_bandwidth"):
        step_seconds(OpCounts(Counter()), FakeGPU(memory_bandwidth=None))
    with pytest.raises(ValueError, match="dtype"):
        step_seconds(OpCounts(Counter()), FakeGPU(), dtype="fp4")


def test_a_4bit_base_counts_the_matmuls_of_its_dequantized_weights():
    # bitsandbytes' 4-bit gemm dequantizes each weight and calls aten.linear whole (inside memkit's dispatch mode):
    # the same matmul FLOPs as the bf16 base, plus the dequantization's bytes
    lora = memkit.LoRA(rank=4)
    kwargs = dict(size="tiny", mode="inference", optimizer=None)
    plain = count_ops("flux", optimizations=[lora], **kwargs)
    nf4 = count_ops("flux", optimizations=[memkit.Quantize(method="nf4"), lora], **kwargs)
    assert nf4.by_class()["matmul"] == plain.by_class()["matmul"] > 0
    assert nf4.by_class("bytes")["elementwise"] > plain.by_class("bytes")["elementwise"]
