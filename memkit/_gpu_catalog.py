"""Each catalog card's compute and bandwidth figures, as its vendor's datasheet or whitepaper gives them.

Plain data for :data:`memkit.gpus.CATALOG` (which applies them by key); the table with every source is the docstring of
:mod:`memkit.gpus`. All FLOP/s are peak *dense* figures: where a sheet prints only the 2:4-sparsity one (NVIDIA marks
it ``*``), it is halved here and the source says so. GeForce tensor cores run FP16/BF16/FP8 with FP32 accumulate at
half the FP16-accumulate rate; the FP32-accumulate figure is the one kept, as it is what PyTorch's bf16 and fp16
matmuls use (cuBLAS accumulates in FP32). Link bandwidths are per direction; a PCIe x16 link is taken at its
theoretical rate after 128b/130b encoding (sheets quote both directions together: "64GB/s bidirectional" is Gen4).
"""

from __future__ import annotations

from types import MappingProxyType

PCIE3_X16 = 15.75e9
"""PCIe 3.0 x16 per direction: 8 GT/s x 16 lanes x 128/130 / 8 bits."""
PCIE4_X16 = 31.5e9
PCIE5_X16 = 63e9


def _spec(flops: dict[str, float] | None, memory_bandwidth: float, host_link: float, nvlink: float | None, source: str):
    return dict(
        flops=None if flops is None else MappingProxyType(flops), memory_bandwidth=memory_bandwidth,
        host_link=host_link, nvlink=nvlink, spec_source=source,
    )  # fmt: skip


SPECS: dict[str, dict] = {
    "t4": _spec(
        dict(fp32=8.1e12, fp16=65e12), 320e9, PCIE3_X16, None,
        "NVIDIA T4 Tensor Core GPU datasheet: single precision 8.1 TFLOPS, mixed precision (FP16/FP32) 65 TFLOPS "
        "(Turing: no TF32, no BF16 tensor cores, no sparsity), GDDR6 320+ GB/s, PCIe Gen3 x16",
    ),
    "l4": _spec(
        dict(fp32=30.3e12, tf32=60e12, bf16=121e12, fp16=121e12, fp8=242.5e12), 300e9, PCIE4_X16, None,
        "NVIDIA L4 Tensor Core GPU datasheet: FP32 30.3 TFLOPS; TF32 120, BF16 and FP16 242, FP8 485 TFLOPS, each "
        "with sparsity (halved here); 300 GB/s; PCIe Gen4 x16 (64 GB/s bidirectional)",
    ),
    "a10g": _spec(
        None, 600e9, PCIE4_X16, None,
        "FLOP/s not found: NVIDIA publishes no A10G datasheet (an AWS-only variant of the A10) and the A10's "
        "(31.2 FP32, 125 BF16 TFLOPS) do not carry over: the A10G's tensor rate is lower, its CUDA-core rate higher "
        "(Baseten, 'NVIDIA A10 vs A10G for ML model inference'); 600 GB/s, the A10's (same); PCIe Gen4 (GA102 "
        "whitepaper); G5 instances link their GPUs over PCIe, no NVLink",
    ),
    "3090": _spec(
        dict(fp32=35.6e12, tf32=35.6e12, bf16=71e12, fp16=71e12), 936e9, PCIE4_X16, 56.25e9,
        "NVIDIA Ampere GA102 GPU Architecture whitepaper, Appendix A (GeForce RTX 3090): peak FP32 (non-Tensor) "
        "35.6, TF32 tensor 35.6, FP16 and BF16 tensor with FP32 accumulate 71 TFLOPS dense (FP16 accumulate: 142); "
        "936 GB/sec; PCIe Gen 4; NVLink 56.25 GB/sec in each direction (112.5 total) between two RTX 3090s",
    ),
    "4090": _spec(
        dict(fp32=82.6e12, tf32=82.6e12, bf16=165.2e12, fp16=165.2e12, fp8=330.3e12), 1008e9, PCIE4_X16, None,
        "NVIDIA Ada GPU Architecture whitepaper (v2.02 or later), Appendix A (GeForce RTX 4090): peak FP32 82.6, TF32 "
        "82.6/165.2, FP16 and BF16 tensor with FP32 accumulate 165.2/330.4, FP8 with FP32 accumulate 330.3/660.6 "
        "TFLOPS (dense/sparse; with FP16 accumulate twice these); 1008 GB/sec; PCIe 4.0 x16; no NVLink",
    ),
    "5090": _spec(
        dict(fp32=104.8e12, bf16=209.5e12, fp16=209.5e12, fp8=419e12), 1792e9, PCIE5_X16, None,
        "NVIDIA RTX Blackwell GPU Architecture whitepaper v1.1, Appendix A (GeForce RTX 5090): peak FP32 104.8, BF16 "
        "and FP16 tensor with FP32 accumulate 209.5, FP8 with FP32 accumulate 419 TFLOPS dense (with FP16 "
        "accumulate: 419 and 838); 1792 GB/sec; PCIe Gen 5; no NVLink. TF32: not found in the sources read",
    ),
    "l40s": _spec(
        dict(fp32=91.6e12, tf32=183e12, bf16=362.05e12, fp16=362.05e12, fp8=733e12), 864e9, PCIE4_X16, None,
        "NVIDIA L40S datasheet: FP32 91.6; TF32 183 | 366*, BF16 and FP16 362.05 | 733*, FP8 733 | 1,466* TFLOPS "
        "(* with sparsity; the dense column kept); 864 GB/s; PCIe Gen4 x16 (64 GB/s bidirectional); no NVLink",
    ),
    "a100-40gb": _spec(
        dict(fp32=19.5e12, tf32=156e12, bf16=312e12, fp16=312e12), 1555e9, PCIE4_X16, 300e9,
        "NVIDIA A100 Tensor Core GPU datasheet: FP32 19.5, TF32 156 | 312*, BF16 and FP16 312 | 624* TFLOPS (* with "
        "sparsity; no FP8); 40GB HBM2 1,555 GB/s; NVLink 600 GB/s (both directions); PCIe Gen4 64 GB/s",
    ),
    "a100-80gb": _spec(
        dict(fp32=19.5e12, tf32=156e12, bf16=312e12, fp16=312e12), 2039e9, PCIE4_X16, 300e9,
        "NVIDIA A100 Tensor Core GPU datasheet: FP32 19.5, TF32 156 | 312*, BF16 and FP16 312 | 624* TFLOPS (* with "
        "sparsity; no FP8); 80GB SXM HBM2e 2,039 GB/s; NVLink 600 GB/s (both directions); PCIe Gen4 64 GB/s",
    ),
    "h100": _spec(
        dict(fp32=66.9e12, tf32=494.7e12, bf16=989.4e12, fp16=989.4e12, fp8=1978.9e12), 3.35e12, PCIE5_X16, 450e9,
        "NVIDIA H100 Tensor Core GPU Architecture whitepaper v1.04, Table 3 (H100 SXM5): peak FP32 66.9, TF32 "
        "494.7/989.4, BF16 and FP16 with FP32 accumulate 989.4/1978.9, FP8 1978.9/3957.8 TFLOPS (dense/sparse); "
        "NVIDIA H100 datasheet (SXM): 3.35 TB/s, NVLink 900 GB/s (both directions), PCIe Gen5 128 GB/s",
    ),
    "h200": _spec(
        dict(fp32=67e12, tf32=494.5e12, bf16=989.5e12, fp16=989.5e12, fp8=1979e12), 4.8e12, PCIE5_X16, 450e9,
        "NVIDIA H200 Tensor Core GPU datasheet (H200 SXM): FP32 67 TFLOPS; TF32 989, BF16 and FP16 1,979, FP8 3,958 "
        "TFLOPS, each with sparsity (halved here); 4.8 TB/s; NVLink 900 GB/s (both directions); PCIe Gen5 128 GB/s",
    ),
    "b200": _spec(
        dict(fp32=75e12, tf32=1.1e15, bf16=2.25e15, fp16=2.25e15, fp8=4.5e15), 7.7e12, PCIE5_X16, 900e9,
        "NVIDIA Blackwell datasheet, Individual Blackwell GPU Specifications, HGX B200: FP32 75 TFLOPS; TF32 2.2, "
        "FP16/BF16 4.5, FP8 9 PFLOPS, 'all Tensor Core numbers except FP64 with sparsity' (halved here; NVIDIA's HGX "
        "page: 36 PFLOPS FP16/BF16 for 8 GPUs, 'Dense is 1/2 sparse spec'); 180GB HBM3E 7.7 TB/s (GB200's: 8); "
        "5th-generation NVLink 1.8 TB/s (both directions); PCIe Gen5 128 GB/s",
    ),
    "mi300x": _spec(
        dict(fp32=163.4e12, tf32=653.7e12, bf16=1307.4e12, fp16=1307.4e12, fp8=2614.9e12), 5.3e12, PCIE5_X16, None,
        "AMD Instinct MI300X datasheet: FP32 vector 163.4, TF32 matrix 653.7 | 1,307.4, FP16 and BF16 1,307.4 | "
        "2,614.9, FP8 2,614.9 | 5,229.8 TFLOPS (| with sparsity); 5.3 TB/s; PCIe Gen 5 x16 128 GB/s; GPU-to-GPU over "
        "AMD Infinity Fabric (128 GB/s a link), not NVLink",
    ),
}  # fmt: skip
"""Catalog key -> the compute and bandwidth fields of :class:`memkit.gpus.GPU`."""
