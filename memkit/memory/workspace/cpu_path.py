"""Which CPU kernel path torch takes in this process, for the kernels whose internal buffers differ by path.

torch picks a path once per process from the CPU and two environment variables read when it loads:
``ATEN_CPU_CAPABILITY`` (aten's vectorized kernels: default, avx2, avx512) and ``ONEDNN_MAX_CPU_ISA`` /
``DNNL_MAX_CPU_ISA`` (oneDNN and its brgemm micro-kernels, which CPU flash attention and half-precision
matmuls use for packing). :func:`cpu_path` names the path; the workspace formulas say which paths they model.

Example:
    >>> from memkit.memory.workspace.cpu_path import cpu_path
    >>> cpu_path().onednn_isa            # e.g. "AVX512_CORE_AMX", or "AVX2" under ONEDNN_MAX_CPU_ISA=AVX2
"""

from __future__ import annotations

import functools
import os
import platform
from dataclasses import dataclass

import torch

from ... import _torch_compat as _compat

# oneDNN's ISA ladder (the values ONEDNN_MAX_CPU_ISA accepts), lowest first, with the CPU flags each needs.
ONEDNN_ISAS: dict[str, tuple[str, ...]] = {
    "SSE41": ("sse4_1",),
    "AVX": ("avx",),
    "AVX2": ("avx2",),
    "AVX2_VNNI": ("avx2", "avx_vnni"),
    "AVX2_VNNI_2": ("avx2", "avx_vnni", "avx_vnni_int8"),
    "AVX512_CORE": ("avx512f", "avx512bw", "avx512vl", "avx512dq"),
    "AVX512_CORE_VNNI": ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni"),
    "AVX512_CORE_BF16": ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni", "avx512_bf16"),
    "AVX10_1_512": ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni", "avx512_bf16", "avx512_fp16"),
    "AVX512_CORE_AMX": ("avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8"),
    "AVX10_1_512_AMX_FP16": ("avx512f", "avx512_fp16", "amx_tile", "amx_bf16", "amx_fp16"),
}
_ALIASES = {"AVX512_CORE_FP16": "AVX10_1_512", "AVX10_1_512_AMX": "AVX512_CORE_AMX", "ALL": None, "DEFAULT": None}


@dataclass(frozen=True)
class CpuPath:
    """The kernel path of this process."""

    x86: bool
    """An x86-64 CPU; the workspace formulas model x86 kernels only."""
    aten_capability: str
    """``torch.backends.cpu.get_cpu_capability()``: DEFAULT, AVX2, AVX512 (or an ARM/other name)."""
    onednn_isa: str
    """The highest oneDNN ISA usable here: the CPU's best, lowered by ``ONEDNN_MAX_CPU_ISA``."""
    amx: bool
    """AMX tiles are usable by oneDNN (the CPU has them and the ISA limit allows them)."""

    def at_most(self, isa: str) -> bool:
        """True when oneDNN is limited to ``isa`` or lower."""
        names = list(ONEDNN_ISAS)
        return self.onednn_isa in names and names.index(self.onednn_isa) <= names.index(isa)


def cpu_flags() -> frozenset[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def supported_isas(flags: frozenset[str] | None = None) -> list[str]:
    """The oneDNN ISA names this CPU supports, lowest first."""
    flags = cpu_flags() if flags is None else flags
    return [isa for isa, need in ONEDNN_ISAS.items() if set(need) <= flags]


def missing_flags(isa: str, flags: frozenset[str] | None = None) -> list[str]:
    flags = cpu_flags() if flags is None else flags
    return sorted(set(ONEDNN_ISAS[_ALIASES.get(isa, isa) or isa]) - flags)


@functools.cache
def cpu_path() -> CpuPath:
    """The path of this process (read once: torch reads the same variables once, when it loads)."""
    machine = platform.machine().lower()
    x86 = machine in ("x86_64", "amd64", "i686", "x86")
    capability = torch.backends.cpu.get_cpu_capability()
    isas = supported_isas() if x86 else []
    best = isas[-1] if isas else "NONE"
    limit = (os.environ.get("ONEDNN_MAX_CPU_ISA") or os.environ.get("DNNL_MAX_CPU_ISA") or "").upper()
    limit = _ALIASES.get(limit, limit)
    if limit and limit in ONEDNN_ISAS and best in ONEDNN_ISAS:
        names = list(ONEDNN_ISAS)
        below = [i for i in isas if names.index(i) <= names.index(limit)]
        best = below[-1] if below else "NONE"
    amx_cpu = _compat.amx_tile_supported()
    return CpuPath(x86=x86, aten_capability=capability, onednn_isa=best, amx=amx_cpu and "AMX" in best)


# Ops whose CPU kernels allocate internal buffers on some path. Measured with torch 2.13 against the profiler:
# fp32 allocates none beyond attention's modelled buffers on every x86 path; bf16 matmuls and bf16 flash
# attention allocate oneDNN/brgemm packing buffers from AVX512_CORE up (and more with AMX); fp16 ones from
# AVX512_CORE_FP16 (AVX10_1_512) up. Those buffers follow oneDNN's blocking (ISA, threads, cache sizes), which no
# formula here follows: a run that meets them learns them from the allocator (learned.py), or else is a lower bound.
# Re-checked against the profiler with torch 2.8.0 and 2.14.1 (`make test-matrix`: tests/test_cpu_paths.py,
# tests/test_workspace_fast.py) on the AVX2 path only (an AVX2 machine); the AVX-512 and AMX paths on 2.13 only.
MATMUL_OPS = frozenset({"mm", "addmm", "bmm", "baddbmm", "addbmm", "_addmm_activation", "addmv", "mv"})
ATTENTION_OPS = frozenset(
    {"_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention_for_cpu_backward"}
)
_FIRST_UNMODELLED_ISA = {torch.bfloat16: "AVX512_CORE", torch.float16: "AVX10_1_512"}


def modelled(op: str, dtype: torch.dtype, path: CpuPath | None = None) -> bool:
    """True when memkit's formulas give the exact internal buffers of ``op`` (an aten op name, without
    overload) on ``path`` (this process's when None) for ``dtype``."""
    path = cpu_path() if path is None else path
    if op not in MATMUL_OPS and op not in ATTENTION_OPS:
        return True
    if not path.x86:  # no formula was checked against another architecture's kernels: learn them all
        return False
    first = _FIRST_UNMODELLED_ISA.get(dtype)
    if first is None:
        return True
    names = list(ONEDNN_ISAS)
    return path.onednn_isa not in names or names.index(path.onednn_isa) < names.index(first)
