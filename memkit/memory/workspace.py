"""Memory that kernels allocate inside themselves and free before returning.

A dispatch mode sees an op's outputs but not the buffers its kernel allocates internally. Most ops have
none; the ones below do, and on a small model they set the peak. Each entry gives the bytes of the
transient buffers from the op's arguments, following the kernel source of torch 2.6–2.13. They are counted
as a ``temporary`` allocation freed right after the op's outputs are allocated, which is the order the
kernels use. What is not modelled: casts a CPU kernel makes of tensor operands of mixed dtypes, buffers
a kernel allocates on worker threads beyond the first (CPU flash-attention backward: ``qSplitSize``
floats per extra thread, which the profiler does not see either), oneDNN packing buffers (half precision
on AMX CPUs only), and CUDA library workspaces (cuBLAS, cuDNN).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

aten = torch.ops.aten

_REDUCED = (torch.float16, torch.bfloat16)


def _accum_size(dtype: torch.dtype) -> int:
    return 4 if dtype in _REDUCED or dtype == torch.float32 else torch.finfo(dtype).bits // 8


def _splits(q_len: int, kv_len: int) -> tuple[int, int]:
    q_split = 256 if q_len >= 768 else 64 if q_len >= 192 else 32
    return min(q_split, q_len), min(512, kv_len)


def _flash_cpu_forward(args, kwargs, out) -> int:
    # cpu_flash_attention: per-thread buf (qk, qk_max, qk_sum, dst) in the accumulate type, plus qk in the
    # input type for half precision. q is (batch, heads, q_len, head_dim).
    q, k = args[0], args[1]
    q_len, head_dim, kv_len = q.shape[2], q.shape[3], k.shape[2]
    q_split, kv_split = _splits(q_len, kv_len)
    threads = torch.get_num_threads()
    per_thread = q_split * kv_split + 2 * q_split + q_split * head_dim
    n = threads * per_thread * _accum_size(q.dtype)
    if q.dtype in _REDUCED:
        n += threads * q_split * kv_split * q.element_size()
    return n


def _flash_cpu_backward(args, kwargs, out) -> int:
    # cpu_flash_attention_backward: grad_out made contiguous in (batch, q_len, heads, head_dim) layout,
    # per-thread buf (attn, grad_attn), its half-precision twin, and one dsum row block.
    grad_out, q, k = args[0], args[1], args[2]
    q_len, kv_len = q.shape[2], k.shape[2]
    q_split, kv_split = _splits(q_len, kv_len)
    threads = torch.get_num_threads()
    accum = _accum_size(q.dtype)
    n = threads * 2 * q_split * kv_split * accum + q_split * accum
    if q.dtype in _REDUCED:
        n += threads * 2 * q_split * kv_split * q.element_size()
    if not grad_out.transpose(1, 2).is_contiguous():
        n += grad_out.numel() * grad_out.element_size()
    return n


_CPU: dict[object, Callable] = {}
for _name, _fn in (
    ("_scaled_dot_product_flash_attention_for_cpu", _flash_cpu_forward),
    ("_scaled_dot_product_flash_attention_for_cpu_backward", _flash_cpu_backward),
):
    _packet = getattr(aten, _name, None)
    if _packet is not None:
        _CPU[_packet.default] = _fn


_WRAPPED_DTYPE = {bool: torch.bool, int: torch.int64, float: torch.float64, complex: torch.complex128}
_tensor_slots: dict[object, tuple[int, ...]] = {}


def _wrapped_scalars(func, args, out) -> int:
    # A Python number passed where the schema takes a Tensor (``x / 2.0``) becomes a 0-dim "wrapped number"
    # tensor: the argument parser allocates one before dispatch, the call below the dispatch mode allocates
    # another, and the kernel casts it to the computation dtype. All three die when the op returns.
    slots = _tensor_slots.get(func)
    if slots is None:
        slots = _tensor_slots[func] = tuple(
            i for i, a in enumerate(func._schema.arguments) if str(a.type) == "Tensor" and not a.kwarg_only
        )
    n = 0
    for i in slots:
        if i < len(args) and type(args[i]) in _WRAPPED_DTYPE:
            wrapped = _WRAPPED_DTYPE[type(args[i])]
            n += 2 * wrapped.itemsize
            tensor = next((a for a in args if isinstance(a, torch.Tensor)), None)
            if tensor is not None:
                common = torch.result_type(tensor, args[i])
                if common != wrapped:
                    n += common.itemsize
    return n


def workspace_bytes(func, args, kwargs, out, device: str | None = None) -> int:
    """Bytes of internal buffers ``func`` allocated and freed while producing ``out`` (0 when none known).

    ``device`` overrides the device the op ran on (an estimate for CUDA run with fake CPU tensors): CPU
    kernels' buffers and CPU-side wrapped numbers are only counted for CPU.
    """
    if device is not None and not device.startswith("cpu"):
        return 0
    n = _wrapped_scalars(func, args, out)
    fn = _CPU.get(func)
    if fn is not None:
        n += fn(args, kwargs, out)
    return n
