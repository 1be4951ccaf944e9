"""GPUs people train on, what of their memory a training step can use, and whether an estimate fits.

A run dies when the caching allocator cannot reserve more; what it can reserve is the card's memory as the driver
reports it (``torch.cuda.get_device_properties(i).total_memory``; ECC, where on, and the driver's own share already
taken) minus what the process holds outside the allocator, the CUDA context (driver, loaded kernels), minus what
torch allocates through the allocator that a training step's tensors are not: cuBLAS's workspace. Each figure has a
source and a spread, and the verdict says which side of the spread an estimate falls:

- **total**: ``total_memory`` as torch prints it (``_CudaDeviceProperties(..., total_memory=NNNNNMB)``, MiB),
  collected from public GitHub files by an exact-string search (2026-11-26); where several runs printed different
  totals (drivers differ) the spread covers them. For a card with no printed total in that search (L4, RTX 5090) the
  spread is derived from its siblings, and says so.
- **CUDA context**: 287,047,680 B with lazy module loading (pytorch/pytorch#86509, torch 1.13: 666,632,192 B
  without it) to 426 MiB (unsloth-zoo#1053: ``nvidia-smi`` after the context's creation, torch 2.10 + CUDA 13, RTX
  6000 Ada); "around 400MB if CUDA >= 11.7 is used and lazy module loading enabled" (pytorch/pytorch#109888).
- **cuBLAS workspace**: torch's default, 32 MiB on sm90 and later, 8,519,680 B before
  (``aten/src/ATen/cuda/CublasHandlePool.cpp``, ``parseChosenWorkspaceSize``; cuBLASLt shares it), allocated through
  the caching allocator once per handle and stream: it is in the real run's reserved memory, not in the estimate of
  the step's tensors. cuDNN's convolution workspaces (UNets) are transient and not modelled.

For a step-time model each card also carries its peak compute and bandwidth (`GPU.flops_for`, ``memory_bandwidth``,
``host_link``, ``nvlink``), from its vendor's datasheet or whitepaper (each card's ``spec_source`` quotes it; the data
is :mod:`memkit._gpu_catalog`'s). FLOP/s are *dense*: a sheet that prints only the 2:4-sparsity figure is halved.
GeForce cards (3090, 4090, 5090) run FP16/BF16/FP8 tensor math with FP32 accumulate at half the FP16-accumulate rate:
the FP32-accumulate figure is kept, as PyTorch's matmuls accumulate in FP32. Links are per direction (PCIe x16 at
15.75/31.5/63 GB/s for Gen3/4/5, after encoding). "-": the card has none; "?": not found in the sources read.

=========  =====  =====  ======  ======  ======  =====  =====  ======  ================================================
card        fp32   tf32    bf16    fp16     fp8  GB/s   PCIe   NVLink  source (TFLOP/s dense; GB/s; "/2": sparse halved)
=========  =====  =====  ======  ======  ======  =====  =====  ======  ================================================
t4           8.1      -       -      65       -    320  Gen3       -   NVIDIA T4 datasheet (mixed precision FP16/FP32)
l4          30.3     60     121     121   242.5    300  Gen4       -   NVIDIA L4 datasheet (tensor rows /2)
a10g           ?      ?       ?       ?       -    600  Gen4       -   no A10G datasheet; 600 GB/s: Baseten, A10 vs A10G
3090        35.6   35.6      71      71       -    936  Gen4   56.25   GA102 whitepaper, appendix A (FP32 accumulate)
4090        82.6   82.6   165.2   165.2   330.3   1008  Gen4       -   Ada whitepaper v2.02+, appendix A (FP32 acc.)
5090       104.8      ?   209.5   209.5     419   1792  Gen5       -   RTX Blackwell whitepaper v1.1, app. A (FP32 acc.)
l40s        91.6    183  362.05  362.05     733    864  Gen4       -   NVIDIA L40S datasheet (its dense column)
a100-40gb   19.5    156     312     312       -   1555  Gen4     300   NVIDIA A100 datasheet (tensor: dense column)
a100-80gb   19.5    156     312     312       -   2039  Gen4     300   NVIDIA A100 datasheet (80GB SXM)
h100        66.9  494.7   989.4   989.4  1978.9   3350  Gen5     450   H100 whitepaper v1.04 table 3; H100 datasheet
h200          67  494.5   989.5   989.5    1979   4800  Gen5     450   NVIDIA H200 datasheet, SXM (tensor rows /2)
b200          75   1100    2250    2250    4500   7700  Gen5     900   NVIDIA Blackwell datasheet, HGX B200 (tensor /2)
mi300x     163.4  653.7  1307.4  1307.4  2614.9   5300  Gen5       -   AMD Instinct MI300X datasheet (dense column)
=========  =====  =====  ======  ======  ======  =====  =====  ======  ================================================

The MI300X's GPU-to-GPU link is AMD Infinity Fabric (128 GB/s a link), not NVLink; the B200's 7.7 TB/s is the HGX
B200's (a GB200's: 8 TB/s).

Example:
    >>> gpu = memkit.gpus.find("4090")
    >>> gpu.name, gpu.usable_bytes()              # ('NVIDIA GeForce RTX 4090', (low, high))
    >>> memkit.gpus.verdict(20 * 2**30, gpu).status          # 'fits'
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from ._gpu_catalog import SPECS

__all__ = ["CATALOG", "DTYPES", "GPU", "Verdict", "find", "judge", "local", "verdict"]

MiB = 1 << 20
GiB = 1 << 30

CONTEXT_BYTES = (287_047_680, 426 * MiB)
"""What the CUDA context holds outside the allocator, low and high (sources in the module docstring)."""

DTYPES = ("fp32", "tf32", "bf16", "fp16", "fp8")
"""The dtypes `GPU.flops_for` takes: fp32 on the CUDA cores (non-tensor), the others on the tensor cores."""


@dataclass(frozen=True)
class GPU:
    """A GPU: its memory as torch reports it (a spread), what a training step can reserve of it, and its peak compute
    and bandwidth (None where unknown, as for a card made from a size).

    Example:
        >>> g = memkit.gpus.find("h100")
        >>> g.total_bytes, g.workspace_bytes, g.usable_bytes()
        >>> g.flops_for("bf16"), g.memory_bandwidth          # (989.4e12, 3.35e12)
    """

    key: str
    """The name ``--gpu`` takes (``"4090"``, ``"a100-80gb"``)."""
    name: str
    """The name the driver gives it."""
    total_bytes: tuple[int, int]
    """``total_memory`` as torch reports it, low and high."""
    source: str
    """Where ``total_bytes`` comes from."""
    sm: int = 80
    """Compute capability x 10 (90 for Hopper): picks torch's default cuBLAS workspace."""
    aliases: tuple[str, ...] = ()
    workspace: int | None = None
    """The BLAS workspaces torch allocates, where they are not cuBLAS's default (ROCm)."""
    flops: Mapping[str, float] | None = field(default=None, hash=False)
    """Peak *dense* (no 2:4 sparsity) FLOP/s by dtype of `DTYPES`; a dtype the card lacks is absent (no fp8 before
    Ada and Hopper, no bf16 tensor cores on the T4). GeForce figures are FP32-accumulate ones, what torch's matmuls
    use."""
    memory_bandwidth: float | None = None
    """Device memory bandwidth, bytes/s."""
    host_link: float | None = None
    """The card's host link (PCIe), bytes/s per direction, theoretical."""
    nvlink: float | None = None
    """GPU-to-GPU NVLink bandwidth per GPU, bytes/s per direction; None where the card has none."""
    spec_source: str = ""
    """Where the compute and bandwidth figures come from (the vendor document, by name)."""

    def __post_init__(self):
        if self.flops is not None and (unknown := set(self.flops) - set(DTYPES)):
            raise ValueError(f"flops: unknown dtypes {sorted(unknown)}; the allowed ones: {', '.join(DTYPES)}")

    def flops_for(self, dtype: str) -> float | None:
        """Peak dense FLOP/s for ``dtype`` (one of `DTYPES`), or None where the card lacks it or it is unknown.

        Example:
            >>> find("4090").flops_for("bf16"), find("a100").flops_for("fp8")     # (165.2e12, None)
        """
        if dtype not in DTYPES:
            raise ValueError(f"dtype={dtype!r}: one of {', '.join(DTYPES)}")
        return None if self.flops is None else self.flops.get(dtype)

    @property
    def workspace_bytes(self) -> int:
        """torch's default cuBLAS workspace on this architecture (allocated through the caching allocator)."""
        if self.workspace is not None:
            return self.workspace
        return 32 * MiB if self.sm >= 90 else 4096 * 1024 * 2 + 16 * 1024 * 8

    def usable_bytes(self) -> tuple[int, int]:
        """What the caching allocator can reserve for a step's tensors: total minus the CUDA context minus the cuBLAS
        workspace, low (the smallest total, the largest context) and high."""
        low, high = self.total_bytes
        return low - CONTEXT_BYTES[1] - self.workspace_bytes, high - CONTEXT_BYTES[0] - self.workspace_bytes


def _mib(low: int, high: int | None = None) -> tuple[int, int]:
    return low * MiB, (high if high is not None else low) * MiB


_PRINTED = "torch's printed total_memory in public GitHub files"
CATALOG: dict[str, GPU] = {
    g.key: replace(g, **SPECS[g.key])
    for g in (
        GPU("t4", "Tesla T4", _mib(15_079, 15_109), f"{_PRINTED} (Colab and others: 15,079-15,109 MiB)", 75),
        GPU(
            "l4", "NVIDIA L4", _mib(22_000, 23_040),
            "no printed total found; a 24 GB ECC data-center GDDR6 board, as the A10G (22,587 MiB printed), so the "
            "spread runs from below the A10G's to 15/16 of 24 GiB (ECC's share)", 89,
        ),
        GPU("a10g", "NVIDIA A10G", _mib(22_587), f"{_PRINTED} (22,587 MiB)", 86),
        GPU("3090", "NVIDIA GeForce RTX 3090", _mib(24_259, 24_268), f"{_PRINTED} (24,259-24,268 MiB)", 86,
            ("rtx3090",)),
        GPU("4090", "NVIDIA GeForce RTX 4090", _mib(24_563), f"{_PRINTED} (24,563 MiB)", 89, ("rtx4090",)),
        GPU(
            "5090", "NVIDIA GeForce RTX 5090", _mib(32_768 - 308, 32_768 - 13),
            "no printed total found; 32 GiB less what its GeForce siblings' drivers keep (RTX 3090: 308 MiB of "
            "24 GiB, RTX 4090: 13 MiB)", 120, ("rtx5090",),
        ),
        GPU("l40s", "NVIDIA L40S", _mib(45_589), f"{_PRINTED} (45,589 MiB)", 89),
        GPU("a100-40gb", "NVIDIA A100-SXM4-40GB", _mib(40_536), f"{_PRINTED} (40,536 MiB)", 80, ("a100-40",)),
        GPU(
            "a100-80gb", "NVIDIA A100-SXM4-80GB", _mib(81_082, 81_920),
            f"{_PRINTED} (81,920 MiB); its low end the H100 80GB's printed total, the same 80 GB of HBM", 80,
            ("a100", "a100-80"),
        ),
        GPU("h100", "NVIDIA H100 80GB HBM3", _mib(81_082, 81_090), f"{_PRINTED} (81,082-81,090 MiB)", 90,
            ("h100-80gb",)),
        GPU("h200", "NVIDIA H200", _mib(143_156), f"{_PRINTED} (143,156 MiB)", 90),
        GPU("b200", "NVIDIA B200", _mib(182_631, 182_642), f"{_PRINTED} (182,631-182,642 MiB)", 100),
        GPU(
            "mi300x", "AMD Instinct MI300X", _mib(196_592),
            f"{_PRINTED} (ROCm, 196,592 MiB); workspaces: hipBLASLt's 76 MiB default (CublasHandlePool.cpp under "
            "USE_ROCM, not shared with hipBLAS) beside a 32 MiB hipBLAS one (taken as cuBLAS's; unverified); the "
            "context's size is CUDA's (no ROCm figure found)", 94, workspace=(32 + 76) * MiB,
        ),
    )
}  # fmt: skip
"""``--gpu`` name -> `GPU`, the cards users train on."""

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(GiB|GB|G)\s*$", re.IGNORECASE)


def find(name: str | GPU) -> GPU:
    """The catalog's GPU of that name (any case, aliases too), or a card of an explicit size (``"24GiB"``, ``"24GB"``:
    its total, from which the context and workspace are taken as for any card; ``G`` means GiB). A `GPU` (as
    `local` returns) is itself: every ``gpu=`` argument takes either.

    Example:
        >>> find("RTX4090").key, find("24GiB").total_bytes     # ('4090', (25769803776, 25769803776))
    """
    if isinstance(name, GPU):
        return name
    key = name.strip().lower().replace("_", "-").replace(" ", "")
    for gpu in CATALOG.values():
        if key == gpu.key or key in gpu.aliases:
            return gpu
    if m := _SIZE.match(name):
        number, unit = float(m.group(1)), m.group(2).lower()
        total = int(number * (1e9 if unit == "gb" else GiB))
        if total <= CONTEXT_BYTES[1] + 32 * MiB:
            raise ValueError(f"gpu={name!r}: {total:,} B is not more than the CUDA context and cuBLAS workspace")
        return GPU(name.strip(), f"a {name.strip()} GPU", (total, total), "the size given", 90)
    names = ", ".join(CATALOG)
    raise ValueError(f"unknown gpu {name!r}: one of {names}, or an explicit size such as 24GiB or 24GB")


def local(index: int = 0) -> GPU | None:
    """This machine's CUDA device ``index`` as a `GPU`, or None where torch sees no CUDA device (a CPU-only build, no
    driver): the catalog's card of the name the driver gives, with its total replaced by the device's own
    ``total_memory`` (and its compute and bandwidth kept), or for a card not in the catalog one made from that total
    (no FLOP/s: step times then need a catalog card, ``gpu="4090"``). What an estimate judges with ``gpu=...`` is the
    same either way: the total less the CUDA context and cuBLAS's workspace.

    Example:
        >>> gpu = memkit.gpus.local()
        >>> gpu.name if gpu else "no CUDA device: estimates stand for one (device='cuda')"
    """
    import torch

    if not isinstance(index, int) or isinstance(index, bool) or index < 0:
        raise ValueError(f"index must be a CUDA device number >= 0, got {index!r}")
    if not torch.cuda.is_available():
        return None
    if index >= torch.cuda.device_count():
        raise ValueError(f"index={index}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    props = torch.cuda.get_device_properties(index)
    total, source = (props.total_memory,) * 2, f"this machine's cuda:{index} (total_memory)"
    for gpu in CATALOG.values():
        if gpu.name == props.name:
            return replace(gpu, total_bytes=total, source=source)
    return GPU(f"cuda:{index}", props.name, total, source, props.major * 10 + props.minor)


@dataclass(frozen=True)
class Verdict:
    """Whether a peak fits a GPU: ``status`` is ``"fits"`` (under the usable spread's low end), ``"does not fit"``
    (over its high end) or ``"within the spread"`` (between: it may or may not; ``fits`` is then False, as a guard
    should be); ``headroom_bytes`` is usable (low end) minus the peak, negative when short.

    Example:
        >>> v = verdict(20 * 2**30, find("4090")); v.fits, v.status, v.headroom_bytes / 2**30
    """

    gpu: GPU
    peak_bytes: int
    status: str
    headroom_bytes: int

    @property
    def fits(self) -> bool:
        return self.status == "fits"

    def describe(self) -> str:
        low, high = self.gpu.usable_bytes()
        return (
            f"{self.status} on {self.gpu.name} ({self.gpu.key}): usable {low / GiB:.2f}-{high / GiB:.2f} GiB, "
            f"peak {self.peak_bytes / GiB:.2f} GiB reserved, headroom {self.headroom_bytes / GiB:+.2f} GiB"
        )


def verdict(peak_reserved_bytes: int, gpu: GPU | str) -> Verdict:
    """Whether a step whose peak *reserved* bytes are ``peak_reserved_bytes`` fits ``gpu`` (a `GPU` or a name for
    `find`): compared with the usable spread (`GPU.usable_bytes`).

    Example:
        >>> verdict(tl.peak_reserved_bytes, "4090").describe()
    """
    gpu = find(gpu)
    if peak_reserved_bytes < 0:
        raise ValueError(f"peak_reserved_bytes must be >= 0, got {peak_reserved_bytes}")
    low, high = gpu.usable_bytes()
    status = (
        "fits" if peak_reserved_bytes <= low else "does not fit" if peak_reserved_bytes > high else "within the spread"
    )
    return Verdict(gpu, peak_reserved_bytes, status, low - peak_reserved_bytes)


def judge(timeline, gpu: GPU) -> None:
    """Write the verdict on ``timeline``'s peak reserved bytes (a CUDA estimate's) for ``gpu`` into its ``meta``:
    ``gpu``, ``gpu_name``, ``usable_bytes`` (low, high), ``fits``, ``verdict`` and ``headroom_bytes``.
    :func:`memkit.estimate` does it when given ``gpu=``.

    Example:
        >>> tl = memkit.estimate("pixart"); judge(tl, find("4090")); tl.meta["fits"]      # True
    """
    peak = timeline.peak_reserved_bytes
    if peak is None:
        raise ValueError("gpu= needs the reserved bytes of a device='cuda' estimate")
    v = verdict(peak, gpu)
    timeline.meta.update(
        gpu=gpu.key, gpu_name=gpu.name, usable_bytes=list(gpu.usable_bytes()), fits=v.fits, verdict=v.status,
        headroom_bytes=v.headroom_bytes,
    )  # fmt: skip
